"""Exactness: our TRITON, EMULATION, XPU and MARLIN writers against the live release's conversion.

For every (vLLM integration, backend, bits, group size, symmetry, act-order, bias, scale
dtype) in `exactness_cases.grid()`, the same synthetic checkpoint (our quantizer, our GPTQ /
AWQ / compressed-tensors packers) is

* loaded and converted by vLLM in its own environment (`vllm_checker.py`, case
  ``wna16_convert``: vLLM's create_weights, weight loaders, process_weights_after_loading and
  `convert_to_wna16_moe_kernel_format`; ``marlin_integration`` for MARLIN, the same with the
  CUDA-only repack replaced by its pure-torch reference), and
* read by our reader and written by our writer here.

Each case then checks, bit for bit:

1. the layer parameters vLLM's loaders built equal our `write_stacked` for that
   integration's layout (GPTQ / AWQ / compressed-tensors / MoeWNA16 — the last one checks our
   MoeWNA16 reading against vLLM's converting loader, GPTQ zero+1 and AWQ reorder included),
   and reading them back with `read_stacked_layer` gives the layer;
2. vLLM's conversion equals our writer's output, where `exactness_cases.expectation` says
   vLLM is right; where we depart on purpose (`departures`), vLLM's output equals a model of
   exactly that vLLM behaviour and ours equals the canonical dequantization;
3. where vLLM refuses (its exception type and message) or gets it wrong, it still does.

Skipped when no vLLM environment exists (`make test` builds `.venv-vllm`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.formats.canonical import QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.readers import LAYOUTS, write_checkpoint, write_stacked
from service.formats.registry import convert, read_layer, read_stacked_layer
from service.oracle import DEFAULT_RULESET
from tests.formats import conversion_records
from tests.formats.exactness_cases import Case, E, Exact, Refused, Wrong, expectation
from tests.formats.exactness_model import VLLM_NAMES, case_options, model_of_vllm, strip_g_idx
from tests.formats.exactness_run import CASES, ROOT, case_layer, case_quant, prepare, run_checker

pytestmark = pytest.mark.parity


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


@dataclass(frozen=True)
class VllmRun:
    """One run of the live vLLM release over every case: its outputs' folder, results and inputs."""

    directory: Path
    results: dict[str, Any]
    inputs: dict[str, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    """Every case through vLLM in one subprocess (one vLLM start-up)."""
    python = _vllm_python()
    directory = tmp_path_factory.mktemp("vllm_cases")
    inputs = prepare(directory)
    return VllmRun(directory, run_checker(python, directory), inputs)


def _assert_tensors(
    got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None], label: str
) -> None:
    for name in sorted(set(got) | set(want)):
        a, b = got.get(name), want.get(name)
        assert (a is None) == (b is None), f"{label}: {name} present on one side only"
        if a is not None and b is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (
                f"{label}: {name} {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
            )
            assert torch.equal(a, b), f"{label}: {name} differs"


# Parameters vLLM 0.33 does not create, so its loaders skip the checkpoint tensors.
NOT_LOADED = {
    "auto_gptq": {"w13_g_idx", "w2_g_idx"},  # GPTQ act-order is refused outright
    "compressed_tensors": {"w13_weight_g_idx", "w2_weight_g_idx"},
    "auto_awq": {"w13_bias", "w2_bias"},  # AutoAWQ registers no bias: load_weights skips it
}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_vllm(case: Case, vllm_run: VllmRun) -> None:
    directory, results = vllm_run.directory, vllm_run.results
    result = results[case.id]
    expected = expectation(case)
    if isinstance(expected, Refused):
        assert not result["ok"], f"vLLM now converts {case.id}: {expected.why}"
        assert result["error_type"] == expected.error_type, result
        assert expected.message in result["error"], result
        return
    assert result["ok"], f"{result['error_type']}: {result['error']}\n{result['where']}"
    vllm = load_file(str(directory / f"{case.id}.out.safetensors"))
    layer = case_layer(case)
    quant = case_quant(case)

    # 1. The stacked parameters vLLM's loaders built are our stacked layout, bit for bit.
    ours_stacked = write_stacked(LAYOUTS[case.stacked], layer, quant)
    skipped = NOT_LOADED.get(case.integration, set())
    loaded = {}
    for name, tensor in ours_stacked.items():
        if name in skipped:
            continue
        theirs = vllm[f"param.{name}"]
        assert theirs.dtype == tensor.dtype and torch.equal(theirs, tensor), f"param {name}"
        loaded[name] = theirs
    if not isinstance(expected, Wrong) or case.integration != "auto_awq":
        back = read_stacked_layer(case.stacked, loaded, replace(quant, desc_act=False))
        reference = layer if case.stacked == "moe_wna16" else strip_g_idx(layer)
        if case.integration == "auto_awq":
            reference = QuantizedMoELayer(
                w13=replace(reference.w13, bias=None), w2=replace(reference.w2, bias=None)
            )
        assert torch.equal(back.w13.dequantize(), reference.w13.dequantize())
        assert torch.equal(back.w2.dequantize(), reference.w2.dequantize())

    # 2. The conversion.
    theirs_out: dict[str, torch.Tensor | None] = {
        ours_name: vllm.get(f"out.{vllm_name}")
        for vllm_name, ours_name in VLLM_NAMES[case.backend].items()
    }
    canonical = read_layer(
        case.source, write_checkpoint(LAYOUTS[case.source], layer, quant), quant, num_experts=E
    )
    options = case_options(case)
    if isinstance(expected, Wrong):
        if expected.drops_g_idx:
            # vLLM converted the layer without its act order, and otherwise right.
            stripped = strip_g_idx(layer)
            case_exact = replace(case, act=False)
            _assert_tensors(theirs_out, model_of_vllm(case_exact, stripped), case.id)
            return
        try:
            ours = convert(canonical, case.backend, source=case.source, options=options).tensors
        except ConversionUnsupported:
            return  # we refuse what vLLM gets wrong
        w13 = theirs_out["w13_weight" if case.backend == "EMULATION" else "w13_qweight"]
        assert w13 is not None
        mine = ours["w13_weight" if case.backend == "EMULATION" else "w13_qweight"]
        assert w13.shape != mine.shape or not torch.equal(w13, mine), expected.why
        return
    assert isinstance(expected, Exact)
    _assert_tensors(theirs_out, model_of_vllm(case, layer), f"{case.id} (model of vLLM)")
    try:
        ours = dict(convert(canonical, case.backend, source=case.source, options=options).tensors)
    except ConversionUnsupported:
        pytest.fail(f"we refuse {case.id}, which vLLM converts")
    if not expected.departures:
        _assert_tensors(theirs_out, dict(ours), case.id)
    if case.backend == "EMULATION":
        assert torch.equal(ours["w13_weight"], layer.w13.dequantize(torch.bfloat16))
        assert torch.equal(ours["w2_weight"], layer.w2.dequantize(torch.bfloat16))


def test_grid_covers_every_outcome_kind() -> None:
    kinds = {type(expectation(case)).__name__ for case in CASES}
    assert kinds == {"Refused", "Wrong", "Exact"}
    exact_without_departures = [
        c
        for c in CASES
        if isinstance(expectation(c), Exact) and not expectation(c).departures  # type: ignore[union-attr]
    ]
    backends = {(c.integration, c.backend) for c in exact_without_departures}
    assert ("moe_wna16/gptq", "TRITON") in backends
    assert ("moe_wna16/awq", "TRITON") in backends
    assert ("compressed_tensors", "TRITON") in backends
    assert ("compressed_tensors", "EMULATION") in backends
    assert ("auto_awq", "EMULATION") in backends


def test_live_conversions_equal_the_record(vllm_run: VllmRun) -> None:
    """The live vLLM release gives exactly its checked-in conversion record: the recording path
    (`make parity-record`) digests what the live comparison sees."""
    record = conversion_records.load(conversion_records.record_path(DEFAULT_RULESET))
    stale = record.stale_for(conversion_records.cases_hash(CASES, vllm_run.inputs))
    assert stale is None, stale
    recorded = record.by_id()
    for case in CASES:
        result = vllm_run.results[case.id]
        produced = vllm_run.directory / f"{case.id}.out.safetensors"
        outputs = load_file(str(produced)) if result["ok"] else {}
        live = conversion_records.outcome(case, result, outputs)
        assert live == recorded[case.id], case.id
