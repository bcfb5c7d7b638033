"""Parity: the oracle against the newest vLLM release itself, over the whole grid, live.

vLLM runs in its own environment (`.venv-vllm`, built by `make test`) through
`tests/parity/vllm_reference.py`, which takes vLLM's real start-up path with only the platform
faked. Every field of every answer must agree: resolved method, MoE method class, backend,
experts class, QuantKey inputs, error type and message, and each backend's verdict and reason.
The live answers must also equal the checked-in record of this release, taken by the same
runner (`make parity-record`): that is what lets `test_records` stand in for releases whose
environments CI does not build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from service.oracle import DEFAULT_RULESET
from tests.parity.compare import differences, ours
from tests.parity.grid import generate
from tests.parity.records import load, record_path
from tests.parity.runner import run_reference, vllm_version

pytestmark = pytest.mark.parity

ROOT = Path(__file__).resolve().parents[2]


def _vllm_python() -> Path:
    configured = os.environ.get("MOE_CONTROL_VLLM_PYTHON")
    if configured:
        path = Path(configured)
        assert path.exists(), f"MOE_CONTROL_VLLM_PYTHON={configured} does not exist"
        return path
    default = ROOT / ".venv-vllm" / "bin" / "python"
    if not default.exists():
        pytest.skip("vLLM reference environment not built (run `make test`)")
    return default


@pytest.fixture(scope="module")
def live() -> tuple[list[dict], list[dict]]:
    """The grid and vLLM's live answers to it."""
    specs = generate()
    assert len(specs) >= 1000
    return specs, run_reference(_vllm_python(), specs)


def test_oracle_matches_vllm_on_the_whole_grid(live: tuple[list[dict], list[dict]]) -> None:
    specs, answers = live
    failures: list[str] = []
    for spec, expected in zip(specs, answers, strict=True):
        diffs = differences(expected, ours(spec))
        if diffs:
            failures.append(f"{spec['id']}: " + "; ".join(diffs))
    passed = len(specs) - len(failures)
    sys.stderr.write(
        f"\nparity: {passed} of {len(specs)} scenarios identical to {DEFAULT_RULESET}\n"
    )
    assert not failures, f"{len(failures)} of {len(specs)} differ:\n" + "\n".join(failures[:30])


def test_live_answers_equal_the_checked_in_record(live: tuple[list[dict], list[dict]]) -> None:
    specs, answers = live
    record = load(record_path(DEFAULT_RULESET))
    assert record.vllm_version == vllm_version(_vllm_python())
    stale = record.stale_for(specs)
    assert stale is None, stale
    changed = [
        f"{answer['id']}: live {answer!r}\n  recorded {recorded!r}"
        for answer, recorded in zip(answers, record.answers, strict=True)
        if answer != recorded
    ]
    assert not changed, (
        f"{len(changed)} of {len(specs)} live answers differ from the record; "
        f"regenerate it with `{record.command}`:\n" + "\n".join(changed[:10])
    )
