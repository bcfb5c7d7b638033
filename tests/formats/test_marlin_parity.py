"""MARLIN / BATCHED_MARLIN writers bit for bit against the live vLLM release's own conversion.

vLLM runs in its own environment through `tests/formats/vllm_checker.py` (cases in
`tests/formats/vllm_cases/marlin.py`), with its CUDA-only weight repack replaced by the
pure-torch reference `marlin_utils_test.marlin_weights`. Three families:

- integration: our quantizer's random layer -> checkpoint tensors (GPTQ, AWQ,
  compressed-tensors) -> on one side vLLM's loaders and `process_weights_after_loading`, on
  the other our reader and writer;
- convert: `convert_to_wna16_moe_kernel_format` called directly, for int8/fp8 activations,
  non-gated layers and the shapes where vLLM's choices are wrong;
- repack: our weight repack against `marlin_weights` for all four tile layouts.

Every output tensor must be identical, except the departures listed per case, each of which
is checked to be exactly the documented difference (see `service/formats/writers/marlin.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.formats.canonical import QuantizedMoELayer
from service.formats.errors import ConversionUnsupported
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.registry import read_layer
from service.formats.synthetic.quantize import random_layer
from service.formats.writers import ConversionOptions
from service.formats.writers import marlin_layout as layout
from service.formats.writers.marlin import (
    marlin_tensors,
    padded_intermediate,
    refuse_removed_activations,
)
from service.oracle import DEFAULT_RULESET, RULESETS

pytestmark = pytest.mark.parity

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "tests" / "formats" / "vllm_checker.py"
E, H = 2, 256

SOURCES = {"auto_gptq": "gptq", "auto_awq": "awq", "compressed_tensors": "compressed-tensors"}


@dataclass(frozen=True)
class Case:
    family: str  # integration | convert | repack
    integration: str = "compressed_tensors"
    backend: str = "MARLIN"
    bits: int = 4
    group: int = 128
    sym: bool = True
    bias: bool = False
    hidden: int = H
    inter: int = 256
    gated: bool = True
    int8: bool = False
    fp8: bool = False
    desc_act: bool = False
    dtype: str = "float16"
    departures: tuple[str, ...] = field(default=())

    @property
    def a8(self) -> bool:
        """8-bit activations (int8 or fp8)."""
        return self.int8 or self.fp8

    @property
    def activation_dtype(self) -> torch.dtype | None:
        return torch.int8 if self.int8 else torch.float8_e4m3fn if self.fp8 else None

    @property
    def source(self) -> str:
        return SOURCES[self.integration]

    @property
    def id(self) -> str:
        parts = [
            self.family,
            self.integration,
            self.backend,
            f"int{self.bits}",
            f"g{self.group}",
            "sym" if self.sym else "asym",
            f"h{self.hidden}",
            f"i{self.inter}",
            *(["bias"] if self.bias else []),
            *([] if self.gated else ["nongated"]),
            *(["int8"] if self.int8 else []),
            *(["fp8"] if self.fp8 else []),
            *(["act"] if self.desc_act else []),
            self.dtype,
        ]
        return "-".join(parts)


def _vllm_scale_orders(case: Case) -> tuple[bool, bool]:
    """Whether vLLM 0.33 writes w13's / w2's scales in the grouped order.

    It passes `size_k = I` for w13, and for AWQ's w2 the unpadded I (GPTQ/CT w2: the padded
    group count times the group size); grouped means `group_size < size_k`, 16-bit
    activations."""
    if case.group == -1 or case.a8:
        return False, False
    padded = layout_padded(case)
    w2_k = case.inter if case.source == "awq" else padded
    return case.group < case.inter, case.group < w2_k


def _our_scale_orders(case: Case) -> tuple[bool, bool]:
    """Grouped when the kernel sees more than one group: K / group_size > 1."""
    if case.group == -1 or case.a8:
        return False, False
    return case.hidden > case.group, layout_padded(case) > case.group


def layout_padded(case: Case) -> int:
    return padded_intermediate(case.inter, case.group)


def _integration_departures(integration: str, group: int, bias: bool) -> tuple[str, ...]:
    if integration == "auto_gptq":
        return ("gptq_sym_zeros",)
    if integration != "auto_awq":
        return ()
    if group == -1:
        return ("awq_channelwise",)
    return ("awq_bias_not_loaded",) if bias else ()


def _integration_cases() -> Iterator[Case]:
    for integration, bits, group, sym, bias in itertools.product(
        SOURCES, (4, 8), (32, 64, 128, -1), (True, False), (False, True)
    ):
        if integration == "auto_gptq" and not sym:
            continue  # vLLM 0.33's AutoGPTQ takes symmetric checkpoints only
        if integration == "auto_awq" and (bits != 4 or sym):
            continue  # AutoAWQ MoE: 4-bit, zero points
        departures = _integration_departures(integration, group, bias)
        yield Case(
            "integration", integration, "MARLIN", bits, group, sym, bias, departures=departures
        )
        if group in (32, -1):  # the intermediate size gets padded (96 -> 128, 80 -> 128)
            inter = 96 if group == 32 else 80
            yield Case(
                "integration",
                integration,
                "MARLIN",
                bits,
                group,
                sym,
                bias,
                inter=inter,
                departures=departures,
            )
    yield Case("integration", "compressed_tensors", "BATCHED_MARLIN", 4, 128, False, True)
    yield Case(
        "integration",
        "auto_awq",
        "BATCHED_MARLIN",
        4,
        64,
        False,
        True,
        inter=128,
        departures=("awq_bias_not_loaded",),
    )
    yield Case("integration", "compressed_tensors", "MARLIN", 4, 64, True, True, dtype="bfloat16")
    yield Case("integration", "auto_awq", "MARLIN", 4, 128, False, False, dtype="bfloat16")
    # GPTQ act-order: vLLM 0.33 refuses the config; we refuse unless asked for the sorted form.
    yield Case("integration", "auto_gptq", "MARLIN", 4, 128, True, False, desc_act=True)


def _convert_cases() -> Iterator[Case]:
    # int8 activations (VLLM_MARLIN_INPUT_DTYPE=int8): the 32-wide scale order, int16 scales.
    for integration, bits, sym, group in itertools.product(
        ("auto_gptq", "compressed_tensors"), (4, 8), (True, False), (32, 128, -1)
    ):
        if integration == "auto_gptq" and not sym:
            continue
        inter = 96 if group == 32 else 256
        departures = ("gptq_sym_zeros",) if integration == "auto_gptq" else ()
        yield Case(
            "convert",
            integration,
            bits=bits,
            group=group,
            sym=sym,
            inter=inter,
            int8=True,
            bias=True,
            departures=departures,
        )
    # Non-gated (one w13 shard): fine unpadded; vLLM's padding helper crashes on it.
    yield Case("convert", "compressed_tensors", group=128, sym=False, gated=False)
    yield Case(
        "convert",
        "compressed_tensors",
        group=32,
        gated=False,
        inter=96,
        departures=("non_gated_padding",),
    )
    # The shapes where vLLM's scale order disagrees with the group count the kernel sees.
    for integration in SOURCES:
        sym = integration != "auto_awq"
        extra = ("gptq_sym_zeros",) if integration == "auto_gptq" else ()
        # I == group < H: vLLM writes w13's grouped scales in the channelwise order.
        yield Case(
            "convert",
            integration,
            group=128,
            sym=sym,
            inter=128,
            bias=True,
            departures=("scale_order", *extra),
        )
        # H == group < I: vLLM writes w13's single group in the grouped order.
        yield Case(
            "convert",
            integration,
            group=128,
            sym=sym,
            hidden=128,
            inter=256,
            departures=("scale_order", *extra),
        )
        # I == group < padded I: w13 as above; AWQ's w2 too, as it uses the unpadded I
        # (GPTQ/CT w2 use the padded one).
        yield Case(
            "convert", integration, group=32, sym=sym, inter=32, departures=("scale_order", *extra)
        )
    # int8 with I == group < padded I: vLLM skips the int16 step for w2 (1 unpadded group).
    yield Case(
        "convert", "compressed_tensors", group=32, inter=32, int8=True, departures=("int8_scales",)
    )


def _repack_cases() -> Iterator[Case]:
    for bits, a8 in itertools.product((4, 8), (False, True)):
        yield Case("repack", bits=bits, int8=a8, hidden=512, inter=256)


def _fp8_cases() -> Iterator[Case]:
    # fp8 activations (VLLM_MARLIN_INPUT_DTYPE=fp8, SM89/SM120): int4 codes remapped around
    # the zero point, scales x512, the 8-bit-activation layouts.
    yield Case(
        "convert", "auto_gptq", group=128, fp8=True, bias=True, departures=("gptq_sym_zeros",)
    )
    yield Case("convert", "auto_gptq", group=32, inter=96, fp8=True, departures=("gptq_sym_zeros",))
    yield Case("convert", "compressed_tensors", group=-1, fp8=True)
    yield Case("convert", "auto_awq", group=128, sym=False, fp8=True, bias=True)
    yield Case("convert", "auto_awq", group=32, sym=False, inter=96, fp8=True)
    # compressed-tensors with zero points: vLLM's GPTQ path remaps around 8, not the zero point.
    yield Case(
        "convert",
        "compressed_tensors",
        group=64,
        sym=False,
        fp8=True,
        departures=("fp8_zero_points",),
    )


CASES = [*_integration_cases(), *_convert_cases(), *_fp8_cases(), *_repack_cases()]
assert len({c.id for c in CASES}) == len(CASES)


def _layer(case: Case) -> QuantizedMoELayer:
    seed = sum(case.id.encode()) % 10_000
    return random_layer(
        E,
        case.hidden,
        case.inter,
        bits=case.bits,
        group_size=case.group,
        symmetric=case.sym,
        generator=torch.Generator().manual_seed(seed),
        gated=case.gated,
        act_order=case.desc_act,
        bias=case.bias,
        scale_dtype=getattr(torch, case.dtype),
    )


def _quant(case: Case) -> SourceQuantization:
    return SourceQuantization(
        bits=case.bits, group_size=case.group, symmetric=case.sym, desc_act=case.desc_act
    )


def _vllm_entry(case: Case) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(checker entry, input tensors) for one case."""
    layer = _layer(case)
    if case.family == "integration":
        spec = {
            "integration": case.integration,
            "method": None,
            "backend": case.backend,
            "bits": case.bits,
            "group_size": case.group,
            "sym": case.sym,
            "desc_act": case.desc_act,
            "has_bias": case.bias,
            "num_experts": E,
            "hidden": case.hidden,
            "intermediate": case.inter,
            "params_dtype": case.dtype,
        }
        tensors = write_checkpoint(LAYOUTS[case.source], layer, _quant(case))
        return {"case": "marlin_integration", "spec": spec}, tensors
    if case.family == "repack":
        spec = {"bits": case.bits, "a8": case.a8}
        return {"case": "marlin_repack", "spec": spec}, {"codes": layer.w13.codes}
    spec = {
        "source": case.source,
        "bits": case.bits,
        "group_size": case.group,
        "sym": case.sym,
        "input_dtype": "int8" if case.int8 else "fp8" if case.fp8 else None,
    }
    tensors = {}
    for name in ("w13", "w2"):
        experts = getattr(layer, name)
        for part in ("codes", "scales", "zeros", "bias"):
            value = getattr(experts, part)
            if value is not None:
                tensors[f"{name}.{part}"] = value
    if case.source == "awq":
        for name in ("w13", "w2"):
            tensors[f"{name}.zeros"] = getattr(layer, name).zero_points()
    return {"case": "marlin_convert", "spec": spec}, tensors


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
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    python = _vllm_python()
    case_dir = tmp_path_factory.mktemp("marlin_cases")
    entries = []
    for case in CASES:
        entry, tensors = _vllm_entry(case)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, case_dir / f"{case.id}.in.safetensors"
        )
        entries.append({"id": case.id, **entry})
    (case_dir / "cases.json").write_text(json.dumps(entries))
    completed = subprocess.run(
        [str(python), str(CHECKER), str(case_dir)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return case_dir, json.loads((case_dir / "results.json").read_text())


def _ours(case: Case) -> dict[str, torch.Tensor | None]:
    layer = _layer(case)
    if case.family == "integration":
        # Through our reader, as ConvertWeights does.
        tensors = write_checkpoint(LAYOUTS[case.source], layer, _quant(case))
        layer = read_layer(case.source, tensors, _quant(case), num_experts=E)
    return marlin_tensors(
        layer,
        activation_dtype=case.activation_dtype,
        backend=case.backend,
    )


# integration output name -> ours
INTEGRATION_NAMES = {
    "out.w13": "w13_qweight",
    "out.w2": "w2_qweight",
    "out.w13_scale": "w13_scales",
    "out.w2_scale": "w2_scales",
    "out.w13_qzeros": "w13_qzeros",
    "out.w2_qzeros": "w2_qzeros",
    "out.w13_input_global_scale": "w13_input_global_scale",
    "out.w2_input_global_scale": "w2_input_global_scale",
    "out.w13_bias": "w13_bias",
    "out.w2_bias": "w2_bias",
}


def _theirs(case: Case, case_dir: Path, result: dict[str, Any]) -> dict[str, torch.Tensor]:
    loaded = load_file(case_dir / f"{case.id}.out.safetensors")
    if case.family != "integration":
        return loaded
    return {ours: loaded[name] for name, ours in INTEGRATION_NAMES.items() if name in loaded}


def _check_departure(
    case: Case,
    departure: str,
    ours: dict[str, torch.Tensor | None],
    theirs: dict[str, torch.Tensor],
) -> set[str]:
    """Check one documented departure; return the output names it accounts for."""
    midpoint = 1 << (case.bits - 1)
    if departure == "gptq_sym_zeros":
        # vLLM converts the v1 zero points (midpoint - 1) that its kernel then ignores: what
        # we would write for a layer whose zero points were all midpoint - 1.
        layer = _layer(case)
        stored = QuantizedMoELayer(
            *(
                dataclasses.replace(
                    e, zeros=torch.full_like(e.scales, midpoint - 1, dtype=torch.uint8)
                )
                for e in (layer.w13, layer.w2)
            )
        )
        expected = marlin_tensors(stored, activation_dtype=case.activation_dtype)
        for name in ("w13_qzeros", "w2_qzeros"):
            assert ours[name] is None
            assert torch.equal(theirs[name], expected[name])
        return {"w13_qzeros", "w2_qzeros"}
    if departure == "scale_order":
        accounted = set()
        for name, vllm_grouped, our_grouped in zip(
            ("w13", "w2"), _vllm_scale_orders(case), _our_scale_orders(case), strict=True
        ):
            if vllm_grouped == our_grouped:
                continue
            ours_t = ours[f"{name}_scales"]
            assert ours_t is not None
            plain = layout.unpermute_scales(ours_t, our_grouped)
            assert not torch.equal(ours_t, theirs[f"{name}_scales"])
            assert torch.equal(layout.permute_scales(plain, vllm_grouped), theirs[f"{name}_scales"])
            accounted.add(f"{name}_scales")
        assert accounted, "expected vLLM's scale order to differ"
        return accounted
    if departure == "awq_bias_not_loaded":
        # AutoAWQ registers no bias parameters, so vLLM's load_weights skips the tensors.
        assert "w13_bias" not in theirs and "w2_bias" not in theirs
        assert ours["w13_bias"] is not None and ours["w2_bias"] is not None
        return {"w13_bias", "w2_bias"}
    if departure == "fp8_zero_points":
        # vLLM remaps codes as q - 8 (or 15 - q) whatever the zero point; we remap around it.
        layer = _layer(case)
        for name in ("w13", "w2"):
            experts = getattr(layer, name)
            remapped = layout.unpack_weights(
                theirs[f"{name}_qweight"], 4, experts.n, experts.k, True
            )
            plain = torch.where(remapped <= 7, remapped + 8, 15 - remapped)
            assert torch.equal(plain, experts.codes)
            assert not torch.equal(theirs[f"{name}_qweight"], ours[f"{name}_qweight"])
        return {"w13_qweight", "w2_qweight"}
    if departure == "int8_scales":
        # vLLM counts w2's unpadded groups (1) and leaves its scales as plain fp16.
        assert "w2_input_global_scale" not in theirs and ours["w2_input_global_scale"] is not None
        w2 = _layer(case).w2
        padded = layout_padded(case)
        raw = torch.zeros(E, padded // case.group, case.hidden, dtype=w2.scales.dtype)
        raw[:, : w2.num_groups] = w2.scales.transpose(1, 2)
        assert torch.equal(theirs["w2_scales"], layout.permute_scales(raw, grouped=False))
        return {"w2_scales", "w2_input_global_scale"}
    raise AssertionError(f"unknown departure {departure}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_marlin_matches_vllm(case: Case, vllm_run: tuple[Path, dict[str, Any]]) -> None:
    case_dir, results = vllm_run
    result = results[case.id]
    if case.desc_act:
        assert not result["ok"] and "no longer supported" in result["error"], result
        with pytest.raises(ConversionUnsupported, match="act-order"):
            _ours(case)
        return
    if "awq_channelwise" in case.departures:
        # AutoAWQ's create_weights sizes its scales hidden_size // group_size = -hidden.
        assert not result["ok"] and "negative dimension" in result["error"], result
        assert _ours(case)["w13_qweight"] is not None
        return
    if "non_gated_padding" in case.departures:
        # vLLM views w13 as two shards to pad it; one shard cannot be viewed so.
        assert not result["ok"] and result["error_type"] == "RuntimeError", result
        ours = _ours(case)
        assert ours["w13_qweight"] is not None
        return
    if case.a8 and not result["ok"]:
        # The live release has no 8-bit Marlin activations (0.34 removed them): it refuses,
        # and so does a conversion for its ruleset. (0.33's bytes for them were proved live
        # while 0.33 was the live release.)
        assert result["error_type"] == "NotImplementedError", result
        assert not RULESETS[DEFAULT_RULESET].conversions.marlin_8bit_activations
        if case.family == "convert":
            options = ConversionOptions(activation_dtype=case.activation_dtype)
            with pytest.raises(ConversionUnsupported, match="no Marlin path"):
                refuse_removed_activations(options, case.backend)
        return
    assert result["ok"], result
    theirs = _theirs(case, case_dir, result)
    if case.family == "repack":
        ours_q = layout.repack_weights(_layer(case).w13.codes, case.bits, case.a8)
        assert torch.equal(ours_q, theirs["qweight"])
        return
    ours = _ours(case)
    accounted: set[str] = set()
    for departure in case.departures:
        accounted |= _check_departure(case, departure, ours, theirs)
    names = (set(theirs) | {n for n, t in ours.items() if t is not None}) - accounted
    assert names, "nothing compared"
    for name in sorted(names):
        mine, vllm = ours.get(name), theirs.get(name)
        assert mine is not None and vllm is not None, (
            f"{name}: ours={mine is not None} vllm={vllm is not None}"
        )
        assert mine.dtype == vllm.dtype, f"{name}: {mine.dtype} vs {vllm.dtype}"
        assert mine.shape == vllm.shape, f"{name}: {list(mine.shape)} vs {list(vllm.shape)}"
        assert torch.equal(mine, vllm), f"{name} differs"


def test_departures_are_only_where_documented() -> None:
    """Our scale-order rule and vLLM's agree on every case not marked as departing."""
    for case in CASES:
        if case.family == "repack":
            continue
        differs = _vllm_scale_orders(case) != _our_scale_orders(case)
        assert differs == ("scale_order" in case.departures), case.id
