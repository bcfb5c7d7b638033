"""Running vLLM 0.33 with the moe-control plugin from the product's environment: the driver
(`vllm_driver.py`) in vLLM's own python, as a subprocess, as the parity tests run their
harness; and the deployments it builds, taken from the parity grid with vLLM's recorded
answers beside them (what vLLM does without the plugin).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.oracle import DEFAULT_RULESET
from tests.parity.grid import generate
from tests.parity.records import load, record_path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
#: vLLM's import alone takes tens of seconds on a busy CI core.
TIMEOUT_S = 900
#: Layers built per deployment (one decision, this many layers).
LAYERS = 3

#: Deployments that reach select_wna16_moe_backend through each integration (AMD Quark's
#: included) and platform kind, with each outcome: a backend chosen, none eligible, a forced
#: backend refused. The last two are decided differently by vLLM 0.32 (the comparison with
#: another release).
SPEC_IDS = (
    "h100|gptq-int4-g128|qwen1.5-moe-a2.7b",
    "t4|gptq-int4-g128|qwen1.5-moe-a2.7b",
    "t4|awq-int4-g128|marlin-bad-intermediate",
    "t4|ct-int4-g128|qwen1.5-moe-a2.7b",
    "v100|gptq-int8-g128|qwen1.5-moe-a2.7b",
    "a100|gptq-int4-g128|forced-triton",
    "mi250x|ct-int4-g128|qwen1.5-moe-a2.7b",
    "xpu|gptq-int4-g128|qwen1.5-moe-a2.7b",
    "h100|quark-int4-g128|qwen1.5-moe-a2.7b",
    "mi300x|quark-uint4-asym-g32|qwen1.5-moe-a2.7b",
    "cpu|gptq-int4-g128|gelu-tanh",
    "cpu|ct-int4-g32|gelu-tanh",
)


def vllm_python() -> Path:
    """vLLM 0.33's python (MOE_CONTROL_VLLM_PYTHON, else .venv-vllm); skips without one."""
    configured = os.environ.get("MOE_CONTROL_VLLM_PYTHON")
    if configured:
        path = Path(configured)
        assert path.exists(), f"MOE_CONTROL_VLLM_PYTHON={configured} does not exist"
        return path
    default = ROOT / ".venv-vllm" / "bin" / "python"
    if not default.exists():
        pytest.skip("vLLM 0.33.0 environment not built (run `make test`)")
    return default


def deployments() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The specs of `SPEC_IDS` and vLLM's recorded answer to each, by id."""
    wanted = set(SPEC_IDS)
    specs = [spec for spec in generate() if spec["id"] in wanted]
    assert {spec["id"] for spec in specs} == wanted, "a spec left the parity grid"
    record = load(record_path(DEFAULT_RULESET))
    answers = {answer["id"]: answer for answer in record.answers if answer["id"] in wanted}
    return specs, answers


@dataclass(frozen=True)
class DriverRun:
    """What one vLLM process did: its answers, per-layer times, the plugin's costs and its
    reporter's counts (see vllm_driver.py), and its stderr."""

    result: dict[str, Any]
    stderr: str

    @property
    def warnings(self) -> list[str]:
        """The plugin's warning lines."""
        return [line for line in self.stderr.splitlines() if "moe-control:" in line]


def run_driver(
    specs: Sequence[dict[str, Any]],
    env: Mapping[str, str],
    *,
    layers: int = LAYERS,
    plugins: str = "first",
) -> DriverRun:
    """Build `layers` layers of each spec in vLLM with the plugin, `env` set; `plugins`:
    load vLLM's plugins "first" (as vLLM does) or "late" (after the decision path)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOE_CONTROL_REPORT_")}
    completed = subprocess.run(
        [str(vllm_python()), str(DRIVER)],
        input=json.dumps({"specs": list(specs), "layers": layers, "plugins": plugins}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        # The reporter gets long enough to give up on a failing server (retries included).
        env={**clean, "PYTHONPATH": "", "MOE_CONTROL_TEST_FLUSH_S": "60", **env},
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    assert lines, completed.stderr[-4000:]
    result = json.loads(lines[-1])
    if env.get("MOE_CONTROL_REPORT_ADDRESS"):
        assert result["reporting"], (
            "the moe-control plugin is not installed in vLLM's environment "
            "(`make install-vllm` installs it):\n" + completed.stderr[-2000:]
        )
    return DriverRun(result, completed.stderr)
