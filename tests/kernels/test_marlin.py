"""MARLIN adapter on CPU: vLLM's encodings, finding the op, and the orchestration around it.

The GEMM itself is vLLM's CUDA code (tests/gpu and bench/gpu_suite.py run it on the H200).
Here a stand-in op with the real op's argument list and semantics (rows picked through the
sorted ids, `top_k` rows per token in GEMM1, router weights multiplied in when asked,
sentinel slots skipped) runs on dense weights read back from the MARLIN writer's tensors, so
the adapter's block size, alignment, buffer sizes, activation and final sum are checked
against the float32 reference without a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from service.formats.writers import ConversionOptions
from service.kernels import marlin
from service.kernels.activation import resolve
from service.kernels.emulation import reference_forward
from service.kernels.errors import KernelUnavailableError
from service.kernels.interface import LayerSpec
from tests.kernels.helpers import random_layer, random_routing, rel_err

# vLLM 0.33.0's `scalar_types.<name>.id`, printed by its own `ScalarType.id`.
VLLM_IDS = {
    "uint4": 1125899906843648,
    "uint4b8": 1125899907892224,
    "uint8b128": 1125899923621888,
}


def test_scalar_type_ids_match_vllm() -> None:
    assert marlin.UINT4.id == VLLM_IDS["uint4"]
    assert marlin.UINT4B8.id == VLLM_IDS["uint4b8"]
    assert marlin.UINT8B128.id == VLLM_IDS["uint8b128"]
    assert marlin.weight_type(4, True) is marlin.UINT4
    assert marlin.weight_type(4, False) is marlin.UINT4B8
    assert marlin.weight_type(8, False) is marlin.UINT8B128
    with pytest.raises(KernelUnavailableError, match="8-bit type with zero points"):
        marlin.weight_type(8, True)


def _vllm_block_size(m: int, top_k: int, e: int) -> int:
    """vLLM's loop in `fused_marlin_moe`, transcribed."""
    for block in [8, 16, 32, 48, 64]:
        if m * top_k / e / block < 0.9:
            break
    return block


@pytest.mark.parametrize("m", [1, 3, 16, 57, 256, 4096, 100000])
@pytest.mark.parametrize(("top_k", "e"), [(2, 8), (8, 128), (1, 4)])
def test_block_size_matches_vllm(m: int, top_k: int, e: int) -> None:
    assert marlin.choose_block_size_m(m, top_k, e) == _vllm_block_size(m, top_k, e)


def test_find_library_prefers_the_setting(tmp_path: Path) -> None:
    lib = tmp_path / marlin.LIBRARY_NAME
    lib.write_bytes(b"")
    assert marlin.find_library({marlin.LIBRARY_ENV: str(lib)}) == lib


def test_missing_library_is_unavailable(tmp_path: Path) -> None:
    if marlin._registered_op() is not None:
        pytest.skip("the op is already registered in this process")
    with pytest.raises(KernelUnavailableError, match="no such file"):
        marlin.load_op(tmp_path / "absent.so")


def test_cpu_is_unavailable() -> None:
    reason = marlin.MarlinExperts.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason


def test_act_order_is_refused() -> None:
    spec = LayerSpec(
        num_experts=2,
        hidden_size=64,
        intermediate_size=64,
        bits=4,
        group_size=32,
        act_order=True,
        layout="MARLIN",
    )
    with pytest.raises(KernelUnavailableError, match="act-order"):
        marlin.MarlinExperts().prepare({}, spec)


class FakeMarlinOp:
    """`moe_wna16_marlin_gemm`'s semantics on dense float32 weights, keyed by weight tensor."""

    def __init__(self) -> None:
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: Any) -> torch.Tensor:
        (a, c, weight, _bias, scales, _as, _gs, _zeros, _ws, sorted_ids, expert_ids, padded,
         topk_weights, block, top_k, mul, type_id, size_m, size_n, size_k) = args[:20]  # fmt: skip
        assert a.shape == (size_m, size_k) and c.shape == (size_m * top_k, size_n)
        assert scales.dtype == a.dtype
        dense, bias = self.dense[weight.data_ptr()]
        self.calls.append({"block": block, "top_k": top_k, "mul": mul, "type": type_id})
        total = int(padded[0])
        flat_w = topk_weights.reshape(-1).float()
        for b in range(total // block):
            expert = int(expert_ids[b])
            for row in sorted_ids[b * block : (b + 1) * block].tolist():
                if row >= size_m * top_k:
                    continue  # padding sentinel
                y = a[row // top_k].float() @ dense[expert].T
                if bias is not None:
                    y = y + bias[expert].float()
                if mul:
                    y = y * flat_w[row]
                c[row] = y.to(c.dtype)
        return c


HIDDEN = 128
CASES = [
    # bits, group, zero points, bias, intermediate
    (4, 32, False, False, 64),
    (4, 32, True, True, 64),
    (8, -1, False, False, 64),
    (4, 32, True, False, 96),  # padded to 128: gate and up shards each get zero channels
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_orchestration_matches_reference(
    case: tuple[int, int, bool, bool, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = pytest.importorskip("service.formats.writers.marlin")
    bits, group, zp, bias, inter = case
    layer = random_layer(
        5, 4, HIDDEN, inter, bits=bits, group_size=group, zero_points=zp, bias=bias,
        scale_dtype=torch.bfloat16,
    )  # fmt: skip
    converted = writer.write_marlin(layer, source="gptq", options=ConversionOptions())
    padded = writer.unpack_marlin(
        converted.tensors,
        bits=bits,
        group_size=group,
        intermediate_size=int(converted.tensors["w2_qweight"].shape[1]) * marlin.TILE,
    )
    fake = FakeMarlinOp()
    for name, experts in (("w13", padded.w13), ("w2", padded.w2)):
        weight = converted.tensors[f"{name}_qweight"]
        fake.dense[weight.data_ptr()] = (experts.dequantize(torch.float32), experts.bias)
    monkeypatch.setattr(marlin, "load_op", lambda library=None: fake)
    monkeypatch.setattr(marlin.MarlinExperts, "_require_cuda", staticmethod(lambda t: None))
    monkeypatch.setattr(
        marlin.MarlinExperts, "_workspace", lambda self, device: torch.zeros(4, dtype=torch.int32)
    )
    backend = marlin.MarlinExperts()
    backend.prepare(converted.tensors, LayerSpec.from_canonical(layer, layout="MARLIN"))
    gen = torch.Generator().manual_seed(1)
    for m in (1, 7):
        x = torch.randn((m, HIDDEN), generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(gen, m, 4, 2)
        out = torch.full_like(x, float("nan"))
        assert backend.forward(x, ids, weights, "silu", out=out) is out
        ref = reference_forward(layer, x, ids, weights, resolve("silu"))
        assert rel_err(out.float(), ref) < 1e-2
    expected_type = marlin.weight_type(bits, zp).id
    assert {c["type"] for c in fake.calls} == {expected_type}
    assert [(c["top_k"], c["mul"]) for c in fake.calls[:2]] == [(2, False), (1, True)]
