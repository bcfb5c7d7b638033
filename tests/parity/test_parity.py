"""Parity: the oracle against vLLM 0.33.0 itself, over the whole generated grid.

vLLM runs in its own environment (`.venv-vllm`, built by `make test`) through
`tests/parity/vllm_reference.py`, which takes vLLM's real start-up path with only the platform
faked. Every field of every answer must agree: resolved method, MoE method class, backend,
experts class, QuantKey inputs, error type and message, and each backend's verdict and reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parity.compare import differences, ours
from tests.parity.grid import generate

pytestmark = pytest.mark.parity

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "parity" / "vllm_reference.py"


def _vllm_python() -> Path:
    configured = os.environ.get("MOE_CONTROL_VLLM_PYTHON")
    if configured:
        path = Path(configured)
        assert path.exists(), f"MOE_CONTROL_VLLM_PYTHON={configured} does not exist"
        return path
    default = ROOT / ".venv-vllm" / "bin" / "python"
    if not default.exists():
        pytest.skip("vLLM 0.33.0 reference environment not built (run `make test`)")
    return default


def test_oracle_matches_vllm_on_the_whole_grid(tmp_path: Path) -> None:
    specs = generate()
    assert len(specs) >= 1000
    grid = tmp_path / "grid.jsonl"
    grid.write_text("".join(json.dumps(spec) + "\n" for spec in specs))
    with grid.open() as stdin:
        completed = subprocess.run(
            [str(_vllm_python()), str(REFERENCE)],
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
            env={**os.environ, "PYTHONPATH": ""},
        )
    assert completed.returncode == 0, completed.stderr[-4000:]
    answers = [json.loads(line) for line in completed.stdout.splitlines() if line.strip()]
    assert len(answers) == len(specs)
    failures: list[str] = []
    for spec, expected in zip(specs, answers, strict=True):
        assert expected["id"] == spec["id"]
        diffs = differences(expected, ours(spec))
        if diffs:
            failures.append(f"{spec['id']}: " + "; ".join(diffs))
    passed = len(specs) - len(failures)
    sys.stderr.write(f"\nparity: {passed} of {len(specs)} scenarios identical to vLLM 0.33.0\n")
    assert not failures, f"{len(failures)} of {len(specs)} differ:\n" + "\n".join(failures[:30])
