"""HUMMING adapter on CPU: the orchestration around humming's indexed GEMM.

humming-kernels only imports with a CUDA driver, and its kernel layout is its own, so the
real thing runs on the H200 (tests/gpu, bench/gpu_suite.py). Here a stand-in `humming`
(a LayerConfig that keeps its fields, heuristics with one interval, and a `humming_forward`
with the indexed GEMM's semantics: row r of the sorted ids reads input row r // top_k and
writes output row r, sentinel slots skipped) runs on the writer's pre-transform schema
tensors, so block-size choice, realignment, activation and the weighted sum are checked
against the float32 reference without a GPU.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.formats import bits as packing
from service.formats.writers.humming import config_tensor, to_humming_schema
from service.kernels import humming
from service.kernels.activation import resolve
from service.kernels.emulation import reference_forward
from service.kernels.errors import KernelInputError
from service.kernels.interface import LayerSpec
from tests.kernels.helpers import random_layer, random_routing, rel_err


def launcher_lookup(intervals: list[Any], shape_m: int) -> dict[str, Any]:
    """humming's `find_kernel_configs_target_index`: the interval with lo < M <= hi."""
    for low, high, config in intervals:
        if low < shape_m <= (high if high > 0 else 1 << 30):
            return dict(config)
    raise RuntimeError("shape_m is not within any range defined in configs.")


class FakeLayerConfig:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def to_str(self) -> str:
        return json.dumps(self.__dict__)


class FakeHumming:
    """The three humming entry points the adapter uses."""

    def __init__(self, blocks: dict[tuple[int, int], int]) -> None:
        self.blocks = blocks  # (N, K) of a projection -> its interval's block size
        self.dense: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.calls: list[dict[str, Any]] = []

    def module(self, name: str) -> Any:
        return SimpleNamespace(
            LayerConfig=FakeLayerConfig,
            GemmType=SimpleNamespace(INDEXED="indexed"),
            get_heuristics_config=self.heuristics,
            humming_forward=self.forward,
        )

    def heuristics(self, *, layer_config: Any, gemm_type: str, **_: Any) -> list[Any]:
        """Like humming's: contiguous intervals from 0 to 1 << 30; the block size this test
        expects from 9 routed rows on, a different one below."""
        assert gemm_type == "indexed"
        block = self.blocks[(layer_config.shape_n, layer_config.shape_k)]
        return [
            [0, 8, {"block_shape": [64, 128, 64]}],
            [8, 1 << 30, {"block_shape": [block, 128, 64]}],
        ]

    def forward(self, config: Any, **kw: Any) -> torch.Tensor:
        a, c, top_k = kw["inputs"], kw["outputs"], kw["top_k"]
        sorted_ids, expert_ids = kw["sorted_ids"], kw["expert_ids"]
        intervals = json.loads(kw["tuning_config"])
        # humming's launcher reads its base kernel data at M = 1, then the valid M's kernel.
        launcher_lookup(intervals, 1)
        block = launcher_lookup(intervals, kw["valid_shape_m"])["block_shape"][0]
        assert json.loads(kw["compute_config"])["gemm_type"] == "indexed"
        assert c.shape == (a.shape[0] * top_k, config.shape_n - config.pad_shape_n)
        self.calls.append({"block": block, "top_k": top_k, "valid_m": kw["valid_shape_m"]})
        dense, bias = self.dense[kw["weight"].data_ptr()]
        for b in range(int(kw["num_tokens_padded"][0]) // block):
            expert = int(expert_ids[b])
            for row in sorted_ids[b * block : (b + 1) * block].tolist():
                if row >= c.shape[0]:
                    continue
                y = a[row // top_k].float() @ dense[expert].T
                if bias is not None:
                    y = y + bias[expert].float()
                c[row] = y.to(c.dtype)
        return c


def _tensors(layer: Any, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[Any]]:
    out: dict[str, torch.Tensor] = {}
    projections = []
    for name, experts in (("w13", layer.w13), ("w2", layer.w2)):
        schema = to_humming_schema(experts, dtype)
        for key, tensor in schema.tensors.items():
            out[f"{name}_{key}"] = tensor
        config = {
            "shape_n": experts.n,
            "shape_k": experts.k,
            "pad_shape_n": 0,
            "pad_shape_k": 0,
            "num_experts": experts.num_experts,
            "c_dtype": str(dtype).removeprefix("torch."),
        }
        out[name + "_humming_config"] = config_tensor(json.dumps(config))
        projections.append((name, experts))
    return out, projections


CASES = [
    # bits, group, zero points, bias, (w13 block, w2 block)
    (4, 32, True, False, (16, 16)),
    (8, -1, False, True, (16, 32)),  # GEMM2 realigned with its own block size
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_orchestration_matches_reference(
    case: tuple[int, int, bool, bool, tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bits, group, zp, bias, blocks = case
    layer = random_layer(
        3, 4, 64, 32, bits=bits, group_size=group, zero_points=zp, bias=bias,
        scale_dtype=torch.bfloat16,
    )  # fmt: skip
    tensors, projections = _tensors(layer, torch.bfloat16)
    fake = FakeHumming({(layer.w13.n, layer.w13.k): blocks[0], (layer.w2.n, layer.w2.k): blocks[1]})
    for name, experts in projections:
        fake.dense[tensors[f"{name}_weight"].data_ptr()] = (
            experts.dequantize(torch.float32),
            experts.bias,
        )
    monkeypatch.setattr(humming, "_humming", fake.module)
    monkeypatch.setattr(humming, "humming_unavailable_reason", lambda: None)
    monkeypatch.setattr(humming, "_require_cuda", lambda weight: None)
    monkeypatch.setattr(
        humming.HummingExperts,
        "_stream_locks",
        lambda self, device: torch.zeros(8, dtype=torch.int32),
    )
    backend = humming.HummingExperts()
    backend.prepare(tensors, LayerSpec.from_canonical(layer, layout="HUMMING"))
    assert backend.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    for m in (1, 9):  # 2 and 18 routed rows: the first and the second interval
        x = torch.randn((m, 64), generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(gen, m, 4, 2)
        out = torch.full_like(x, float("nan"))
        assert backend.forward(x, ids, weights, "silu", out=out) is out
        ref = reference_forward(layer, x, ids, weights, resolve("silu"))
        assert rel_err(out.float(), ref) < 1e-2
        with pytest.raises(KernelInputError, match="converted for"):
            backend.forward(x.half(), ids, weights, "silu")
    gemm1, gemm2 = fake.calls[-2:]
    assert (gemm1["top_k"], gemm2["top_k"]) == (2, 1)
    assert (gemm1["block"], gemm2["block"]) == blocks
    assert gemm1["valid_m"] == gemm2["valid_m"] == 9 * 2


def test_schema_packing_is_compressed_tensors_order() -> None:
    """weight: codes along K, lowest code in the lowest bits; zero points along N."""
    layer = random_layer(4, 2, 64, 32, bits=4, group_size=32, zero_points=True)
    schema = to_humming_schema(layer.w13, torch.float16)
    weight = schema.tensors["weight"]
    assert weight.dtype == torch.int32 and tuple(weight.shape) == (2, 64, 8)
    word = int(weight[1, 5, 3]) & 0xFFFFFFFF
    codes = layer.w13.codes[1, 5, 24:32].tolist()
    assert word == sum(c << (4 * i) for i, c in enumerate(codes))
    zeros = schema.tensors["zero_point"]
    assert tuple(zeros.shape) == (2, 8, 2)
    assert torch.equal(packing.unpack(zeros, 4, 1), layer.w13.zeros)
    assert schema.config == {
        "quant_method": "humming",
        "b_dtype": "uint4",
        "bs_dtype": "float16",
        "weight_scale_group_size": 32,
        "has_zero_point": True,
    }
