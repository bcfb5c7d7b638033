"""BATCHED_MARLIN adapter on CPU: the dispatch into expert batches, the batched alignment,
and the whole forward through the MARLIN tests' stand-in op (the real GEMM runs in
tests/gpu/test_backends_gpu.py and bench/gpu_suite.py on the H200)."""

from __future__ import annotations

import pytest
import torch

from service.formats.writers import ConversionOptions
from service.kernels import batched_marlin, marlin
from service.kernels.activation import resolve
from service.kernels.emulation import reference_forward
from service.kernels.interface import LayerSpec
from tests.kernels.helpers import random_layer, random_routing, rel_err
from tests.kernels.test_marlin import FakeMarlinOp


def test_alignment_matches_vllms_documented_example() -> None:
    """`batched_moe_align_block_size`'s docstring: 5 batches of 8, block 4, counts
    [2, 3, 0, 6, 8]. (Its expert_ids line reads 0,1,3,3,4,5,5, which contradicts its own
    sorted_ids; the blocks of those sorted_ids belong to experts 0,1,3,3,4,4.)"""
    counts = torch.tensor([2, 3, 0, 6, 8], dtype=torch.int32)
    aligned = batched_marlin.batched_align(counts, max_tokens=8, block_size=4)
    s = 40
    expected = [0, 1, s, s, 8, 9, 10, s, 24, 25, 26, 27, 28, 29, s, s]
    expected += list(range(32, 40)) + [s] * 16
    assert aligned.sorted_ids.tolist() == expected
    assert aligned.expert_ids.tolist() == [0, 1, 3, 3, 4, 4] + [-1] * 4
    assert aligned.num_tokens_post_padded.tolist() == [24]
    assert aligned.sorted_ids.dtype == aligned.expert_ids.dtype == torch.int32


@pytest.mark.parametrize(("t", "block"), [(1, 8), (7, 8), (9, 16), (64, 64), (100, 64)])
def test_alignment_against_a_loop(t: int, block: int) -> None:
    gen = torch.Generator().manual_seed(t)
    counts = torch.randint(0, t + 1, (6,), generator=gen, dtype=torch.int32)
    aligned = batched_marlin.batched_align(counts, t, block)
    sentinel = 6 * t
    ids: list[int] = []
    experts: list[int] = []
    for e, c in enumerate(counts.tolist()):
        padded = -(-c // block) * block
        ids += [e * t + i if i < c else sentinel for i in range(padded)]
        experts += [e] * (padded // block)
    size = 6 * (-(-t // block) * block)
    assert aligned.sorted_ids.tolist() == ids + [sentinel] * (size - len(ids))
    assert aligned.expert_ids.tolist() == experts + [-1] * (size // block - len(experts))
    assert int(aligned.num_tokens_post_padded) == len(ids)


@pytest.mark.parametrize("t", [1, 5, 8, 9, 40, 57, 58, 1000])
def test_block_size_is_vllms(t: int) -> None:
    expected = 64
    for b_m in [8, 16, 32, 48, 64]:  # batched_fused_marlin_moe's loop, transcribed
        if t / b_m < 0.9:
            expected = b_m
            break
    assert batched_marlin.batch_block_size(t) == expected


def test_dispatch_puts_each_route_in_its_experts_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn((9, 4), generator=gen)
    ids, _ = random_routing(gen, 9, 5, 2)
    batch = batched_marlin.dispatch(hidden, ids, 5)
    flat = ids.reshape(-1).long()
    assert batch.counts.tolist() == torch.bincount(flat, minlength=5).tolist()
    assert batch.max_tokens == int(batch.counts.max())
    assert torch.equal(batch.slots // batch.max_tokens, flat)  # each route in its expert's rows
    assert torch.equal(batch.rows[batch.slots], hidden.repeat_interleave(2, dim=0))
    assert batch.slots.unique().numel() == flat.numel()


HIDDEN = 128
CASES = [(4, 32, False, False, 64), (4, 32, True, True, 96), (8, -1, False, False, 64)]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_forward_through_the_op_matches_reference(
    case: tuple[int, int, bool, bool, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = pytest.importorskip("service.formats.writers.marlin")
    bits, group, zp, bias, inter = case
    layer = random_layer(
        5, 4, HIDDEN, inter, bits=bits, group_size=group, zero_points=zp, bias=bias,
        scale_dtype=torch.bfloat16,
    )  # fmt: skip
    converted = writer.write_batched_marlin(layer, source="gptq", options=ConversionOptions())
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
    backend = batched_marlin.BatchedMarlinExperts()
    backend.prepare(converted.tensors, LayerSpec.from_canonical(layer, layout="BATCHED_MARLIN"))
    gen = torch.Generator().manual_seed(1)
    for m in (1, 7, 30):
        x = torch.randn((m, HIDDEN), generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(gen, m, 4, 2)
        out = torch.full_like(x, float("nan"))
        assert backend.forward(x, ids, weights, "silu", out=out) is out
        ref = reference_forward(layer, x, ids, weights, resolve("silu"))
        assert rel_err(out.float(), ref) < 1e-2
    # vLLM's batched call: top_k 1 in both GEMMs, ones multiplied in by GEMM2.
    assert {(c["top_k"], c["mul"]) for c in fake.calls} == {(1, False), (1, True)}
    assert {c["type"] for c in fake.calls} == {marlin.weight_type(bits, zp).id}


def test_cpu_is_unavailable() -> None:
    reason = batched_marlin.BatchedMarlinExperts.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason


def test_worker_profile_reports_each_backend() -> None:
    """The worker's profile says which backends run here and why the others do not."""
    from service.ipc.messages import Profile
    from service.worker.main import Worker

    kernels = Worker("cpu").profile(Profile()).kernels
    assert set(kernels) == {"EMULATION", "TRITON", "HUMMING", "MARLIN", "BATCHED_MARLIN"}
    assert kernels["EMULATION"] == {"available": True, "reason": ""}
    for name in ("MARLIN", "BATCHED_MARLIN"):
        assert not kernels[name]["available"] and "CUDA" in kernels[name]["reason"]


GPU_CASES = [
    ("int4-g128-sym", "small"),
    ("int4-g128-zp", "small"),
    ("int8-ch-sym", "small"),
    ("int4-g128-sym-bias", "small"),
    ("int4-g32-zp", "padded"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("variant", "shape"), GPU_CASES, ids=["-".join(c) for c in GPU_CASES])
def test_gpu_matches_reference_and_marlin(variant: str, shape: str) -> None:
    """The real op on the H200: against the float32 reference (poisoned buffers, NaN-filled
    output), and against MARLIN on the same tensors (the same GEMMs, batched differently)."""
    from bench import gpu_suite as suite
    from service.kernels.routing import topk_route

    shapes = {
        "small": suite.Shape("small", experts=8, top_k=2, hidden=512, intermediate=256),
        # I=160 pads to 192 with group 32: the padded shards.
        "padded": suite.Shape("padded", experts=4, top_k=2, hidden=256, intermediate=160),
    }
    device = torch.device("cuda")
    dims = shapes[shape]
    layer = suite.random_layer(dims, suite.VARIANTS[variant], seed=7, device=device)
    reference = suite.Reference(layer)
    try:
        batched, _ = suite.build_backend("BATCHED_MARLIN", layer, device)
        plain, _ = suite.build_backend("MARLIN", layer, device)
    except suite.KernelUnavailable as exc:
        pytest.skip(f"Marlin unavailable here: {exc}")
    assert isinstance(batched, batched_marlin.BatchedMarlinExperts)
    gen = torch.Generator(device=device)
    gen.manual_seed(11)
    for m in (1, 16, 200):
        x = torch.randn((m, dims.hidden), generator=gen, device=device).to(torch.bfloat16)
        weights, ids = topk_route(
            torch.randn((m, dims.experts), generator=gen, device=device), dims.top_k
        )
        ref = reference(x, ids, weights, "silu")
        suite.poison(device, 64 << 20)
        out = torch.full_like(x, float("nan"))
        assert batched.forward(x, ids, weights, "silu", out=out) is out
        assert bool(torch.isfinite(out).all()), f"M={m}: unwritten (NaN) output"
        rel = float((out.float() - ref).norm() / ref.norm())
        assert rel < suite.TOLERANCE, f"M={m}: relative error {rel:.3e}"
        other = plain.forward(x, ids, weights, "silu").float()
        assert float((out.float() - other).norm() / other.norm()) < 5e-3
