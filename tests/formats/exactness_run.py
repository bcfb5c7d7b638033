"""The exactness grid's checkpoints, and one run of a vLLM release's own conversions over them.

Shared by the live exactness test (vLLM 0.33.0 in `.venv-vllm`) and the conversion recorder
(any release's environment): both build the same synthetic checkpoints, seeded by the case's
place in the grid, and hand them to `vllm_checker.py` in one subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from service.formats.canonical import QuantizedMoELayer
from service.formats.readers import LAYOUTS, write_checkpoint
from service.formats.synthetic.quantize import random_layer
from tests.formats.exactness_cases import INTER, Case, E, H, grid
from tests.formats.exactness_model import case_quant

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "tests" / "formats" / "vllm_checker.py"
CASES: list[Case] = grid()


def case_layer(case: Case) -> QuantizedMoELayer:
    """The case's random layer (the same on every run: seeded by the case's grid index)."""
    return random_layer(
        E,
        H,
        INTER,
        bits=case.bits,
        group_size=case.group_size,
        symmetric=case.sym,
        generator=torch.Generator().manual_seed(CASES.index(case)),
        act_order=case.act,
        bias=case.bias,
        scale_dtype=case.dtype,
    )


def case_checkpoint(case: Case) -> dict[str, torch.Tensor]:
    """The per-expert checkpoint tensors of the case, in its source layout."""
    return write_checkpoint(LAYOUTS[case.source], case_layer(case), case_quant(case))


def prepare(directory: Path, cases: list[Case] = CASES) -> dict[str, dict[str, torch.Tensor]]:
    """Write every case's checkpoint and `cases.json` for `vllm_checker.py`; return the
    checkpoints by case id."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a thread pool only adds hand-offs
    entries = []
    inputs = {}
    try:
        for case in cases:
            inputs[case.id] = checkpoint = case_checkpoint(case)
            save_file(checkpoint, str(directory / f"{case.id}.in.safetensors"))
            entries.append({"id": case.id, "case": case.checker, "spec": case.spec()})
    finally:
        torch.set_num_threads(threads)
    (directory / "cases.json").write_text(json.dumps(entries))
    return inputs


def run_checker(python: Path, directory: Path, *, timeout: float = 900) -> dict[str, Any]:
    """Run `vllm_checker.py` with `python` (a release's venv) over a prepared directory and
    return its results (the per-case outputs stay in `directory`)."""
    completed = subprocess.run(
        [str(python), str(CHECKER), str(directory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if completed.returncode != 0:
        tail = completed.stderr[-4000:]
        raise RuntimeError(f"vllm_checker failed ({completed.returncode}): {tail}")
    results: dict[str, Any] = json.loads((directory / "results.json").read_text())
    return results
