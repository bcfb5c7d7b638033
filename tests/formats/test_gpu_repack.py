"""The fused Triton repack kernels give the torch direct routes' bytes, word for word.

On a machine without a CUDA GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
set before the kernel is first decorated) on CPU tensors, at small shapes; the `gpu` tests
run them compiled on the H200 at Mixtral's size. Each kernel is checked twice: on random
int32 words (every bit pattern, the bare transform against the route's torch transform)
and through `direct.try_direct` over the variants a layer can have (4/8 bit, channelwise
and grouped, symmetric and asymmetric) against the canonical route. The interpreter accepts what the
compiler rejects (the kernels' first H200 run failed to compile: `Any` annotations on the
kernel's parameters, which the compiler evaluates as globals), so every launched variant
is also compiled for sm_90a here, on the CPU.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

from service.formats import direct, gpu_repack
from tests.formats.test_direct import E, _checkpoint, _same
from tests.kernels._ttgir import compiled_asm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels run on this test's device (the CPU under the interpreter)."""
    monkeypatch.setattr(gpu_repack, "KERNEL_DEVICES", {"cuda", DEVICE.type})


KERNEL_ROUTES = sorted(
    (layout, backend, bits)
    for (layout, backend), route in direct.ROUTES.items()
    for bits in route.kernels
)


def _stored_and_out(
    layout: str, backend: str, bits: int, *, n: int, k: int, seed: int
) -> tuple[torch.Tensor, direct.Route, torch.Tensor]:
    route = direct.ROUTES[(layout, backend)]
    per_word = 32 // bits
    shape = (k // per_word, n) if layout == "gptq" else (k, n // per_word)
    gen = torch.Generator().manual_seed(seed)
    stored = torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int64, generator=gen)
    return stored.to(torch.int32).to(DEVICE), route, route.target.allocate(1, n, k, bits, DEVICE)


def _both(layout: str, backend: str, bits: int, *, n: int, k: int, seed: int = 0) -> None:
    """One expert's weight through the kernel and through the torch transform; also
    rows [n/2, n) of the output only (w3 into its half of w13)."""
    stored, route, out = _stored_and_out(layout, backend, bits, n=n, k=k, seed=seed)
    want = torch.full_like(out, 0x5A)
    got = torch.full_like(out, 0x5A)
    for start, stop in ((0, n), (n // 2, n)):
        part = stored if start == 0 else _rows_of(layout, stored, start, stop, bits)
        rows = stop - start
        route.weight[bits](part, route.target.rows(want[0], start, stop, bits), bits)
        route.kernels[bits](part, route.target.rows(got[0], start, stop, bits), bits)
        assert rows > 0
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _rows_of(layout: str, stored: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    """The stored words of output rows [start, stop) (N is the column axis of both)."""
    per_word = 1 if layout == "gptq" else 32 // bits
    return stored[:, start // per_word : stop // per_word].contiguous()


# (layout, backend) -> shapes (n, k) the route takes: whole Marlin tiles; TRITON any N its
# writer takes (odd N at 8 bits); AWQ's K a multiple of 8 (its torch transform's rule).
SHAPES = {
    ("gptq", "MARLIN"): [(128, 128), (256, 256)],
    ("gptq", "BATCHED_MARLIN"): [(128, 128)],
    ("awq", "MARLIN"): [(128, 128)],
    ("awq", "BATCHED_MARLIN"): [(128, 128)],
    ("gptq", "TRITON"): [(6, 64), (130, 96), (256, 512)],
    ("awq", "TRITON"): [(16, 8), (48, 72), (256, 512)],
}


@pytest.mark.parametrize(("layout", "backend", "bits"), KERNEL_ROUTES)
def test_kernel_equals_torch_transform(layout: str, backend: str, bits: int) -> None:
    for seed, (n, k) in enumerate(SHAPES[(layout, backend)]):
        odd = bits == 8 and layout == "gptq" and backend == "TRITON"  # 8-bit: odd N too
        _both(layout, backend, bits, n=n + (odd and n % 2 == 0), k=k, seed=seed)


def test_tables_use_the_widest_fields() -> None:
    """A word transpose moves words, int8 Marlin bytes, int4 routes nibbles."""
    cpu = torch.device("cpu")
    widths = {
        (layout, backend, bits): kernel.table(cpu).width
        for (layout, backend), route in direct.ROUTES.items()
        for bits, kernel in route.kernels.items()
        if backend != "BATCHED_MARLIN"
    }
    assert widths == {
        ("gptq", "TRITON", 4): 32,
        ("gptq", "TRITON", 8): 32,
        ("awq", "TRITON", 4): 4,
        ("gptq", "MARLIN", 4): 4,
        ("gptq", "MARLIN", 8): 8,
        ("awq", "MARLIN", 4): 4,
    }


# Every layer variant the kernels take: 4/8 bit x channelwise/grouped x sym/asym.
LAYER_GRID = [
    pytest.param(
        layout,
        backend,
        bits,
        group,
        sym,
        id=f"{layout}-{backend}-int{bits}-g{group}-{'sym' if sym else 'asym'}",
    )
    for layout, backend, bits in KERNEL_ROUTES
    for group in (-1, 32, 128)
    for sym in (True, False)
    if backend != "BATCHED_MARLIN" or group == 128
]


@pytest.mark.parametrize(("layout", "backend", "bits", "group", "sym"), LAYER_GRID)
def test_layer_through_kernels_equals_canonical(
    layout: str, backend: str, bits: int, group: int, sym: bool
) -> None:
    tensors, quant = _checkpoint(
        layout,
        bits=bits,
        group=group,
        sym=sym,
        bias=not sym,
        dtype=torch.bfloat16 if group == 32 else torch.float16,
        gated=group != -1 or sym,
        seed=bits + group,
    )
    on_device = {name: t.to(DEVICE) for name, t in tensors.items()}
    gated = group != -1 or sym
    got = direct.try_direct(layout, on_device, quant, backend, num_experts=E, gated=gated)
    assert got is not None
    want = direct.canonical(layout, tensors, quant, backend, num_experts=E, gated=gated)
    _same(direct.ConvertedLayer({n: t.cpu() for n, t in got.tensors.items()}, got.descriptor), want)


def test_cpu_default_keeps_the_torch_transforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the device in KERNEL_DEVICES (a plain CPU run) no kernel is called."""
    monkeypatch.setattr(gpu_repack, "KERNEL_DEVICES", {"cuda"})
    calls: list[str] = []
    kernel = direct.ROUTES[("gptq", "MARLIN")].kernels[4]
    monkeypatch.setattr(type(kernel), "__call__", lambda *a: calls.append("kernel"))
    tensors, quant = _checkpoint("gptq")
    got = direct.try_direct("gptq", tensors, quant, "MARLIN", num_experts=E)
    assert got is not None and calls == []


#: The kernel's parameters a launch at Mixtral's size specializes as multiples of 16 (fresh
#: allocations, strides and tile counts of 16 k) - what lets the compiler vectorize.
ALIGNED = ("src", "dst", "table", "src_stride", "dst_stride", "tile_rows", "tile_cols")


def _launched_variants() -> dict[str, list[tuple[str, str, int]]]:
    """Each distinct set of constexprs `gpu_repack._launch` passes (as JSON) -> the routes
    (layout, backend, bits) that launch it."""
    cpu = torch.device("cpu")
    found: dict[str, list[tuple[str, str, int]]] = {}
    for layout, backend, bits in KERNEL_ROUTES:
        kernel = direct.ROUTES[(layout, backend)].kernels[bits]
        assert isinstance(kernel, gpu_repack.Repack)
        consts = gpu_repack.launch_constexprs(kernel, kernel.table(cpu))
        found.setdefault(json.dumps(consts, sort_keys=True), []).append((layout, backend, bits))
    return found


@pytest.mark.parametrize("aligned", [ALIGNED, ()], ids=["aligned", "unaligned"])
def test_kernels_compile_for_sm90(aligned: tuple[str, ...]) -> None:
    """Every route's kernel, with the constexprs and argument types its launch uses,
    compiles for sm_90a (no GPU needed). Aligned as at Mixtral's size, the word transpose
    loads and stores int32 x 4 vectors and the untransposed routes store them (their loads
    are gathers through the table: one word each, coalesced across a warp's lanes)."""
    variants = _launched_variants()
    asm = compiled_asm(
        "service.formats.gpu_repack_kernel",
        "repack_kernel",
        [json.loads(v) for v in variants],
        types={"src": "*i32", "dst": "*i32", "table": "*i32"},
        options={"num_warps": gpu_repack.NUM_WARPS},
        aligned=aligned,
    )
    for (consts, routes), compiled in zip(variants.items(), asm, strict=True):
        ops = Counter(re.findall(r"\b(ld|st)\.global(\.v\d)?\.b32\b", compiled["ptx"]))
        assert ops[("ld", "")] + ops[("ld", ".v4")] > 0, routes
        if not aligned:
            continue
        if json.loads(consts)["WORD_TRANSPOSE"]:
            assert ops[("ld", ".v4")] and ops[("st", ".v4")] and not ops[("ld", "")], (routes, ops)
        elif not json.loads(consts)["TRANSPOSED"]:
            assert ops[("st", ".v4")] and not ops[("st", "")], (routes, ops)
    assert sorted(r for rs in variants.values() for r in rs) == KERNEL_ROUTES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("layout", "backend", "bits"), KERNEL_ROUTES)
def test_kernel_at_mixtral_size(layout: str, backend: str, bits: int) -> None:
    """w13 of one Mixtral-8x7B expert (N = 2 x 14336, K = 4096) and its w2 shape."""
    _both(layout, backend, bits, n=28672, k=4096, seed=1)
    _both(layout, backend, bits, n=4096, k=14336, seed=2)
