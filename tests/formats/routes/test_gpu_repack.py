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

from service.formats.routes import direct, gpu_repack
from service.formats.routes.canonical import canonical
from service.formats.writers import ConvertedLayer
from tests.formats.routes.test_direct import E, _checkpoint, _same
from tests.kernels.triton._ttgir import compiled_asm

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


def _kernel_of(layout: str, backend: str, bits: int) -> gpu_repack.Repack:
    kernel = direct.ROUTES[(layout, backend)].kernels[bits]
    assert isinstance(kernel, gpu_repack.Repack)
    return kernel


def _stored_and_out(
    layout: str, backend: str, bits: int, *, n: int, k: int, seed: int
) -> tuple[torch.Tensor, direct.Route, torch.Tensor]:
    route = direct.ROUTES[(layout, backend)]
    per_word = 32 // bits
    shape = (k // per_word, n) if layout == "gptq" else (k, n // per_word)
    gen = torch.Generator().manual_seed(seed)
    stored = torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int64, generator=gen)
    return stored.to(torch.int32).to(DEVICE), route, route.target.allocate(1, n, k, bits, DEVICE)


def _both(
    layout: str,
    backend: str,
    bits: int,
    *,
    n: int,
    k: int,
    seed: int = 0,
    kernel: gpu_repack.Repack | None = None,
) -> None:
    """One expert's weight through a kernel (the route's, unless given) and through the
    torch transform; also rows [n/2, n) of the output only (w3 into its half of w13)."""
    kernel = kernel or _kernel_of(layout, backend, bits)
    stored, route, out = _stored_and_out(layout, backend, bits, n=n, k=k, seed=seed)
    want = torch.full_like(out, 0x5A)
    got = torch.full_like(out, 0x5A)
    for start, stop in ((0, n), (n // 2, n)):
        part = stored if start == 0 else _rows_of(layout, stored, start, stop, bits)
        rows = stop - start
        route.weight[bits](part, route.target.rows(want[0], start, stop, bits), bits)
        kernel(part, route.target.rows(got[0], start, stop, bits), bits)
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


def test_dedicated_marlin_kernels_take_whole_tile_blocks() -> None:
    """Marlin int4 at a shape that is not whole blocks of tiles (3 k tiles x 10 n tiles,
    5 in the second half; a block is 2 x 16): the masked edges write nothing outside."""
    for layout in ("gptq", "awq"):
        _both(layout, "MARLIN", 4, n=640, k=48, seed=7)


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


# The layer variants the kernels take: 4/8 bit x (channelwise asymmetric non-gated, g32
# asymmetric with bias in bf16, g128 symmetric). The kernel sees only the weight, whose
# words do not depend on the group or zero points; the other tensors' variants are
# tests/formats/routes/test_direct.py's grid (the interpreter makes each case here costly).
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
    for group, sym in ((-1, False), (32, False), (128, True))
    if backend != "BATCHED_MARLIN" or group == 128
]


@pytest.mark.parametrize(("layout", "backend", "bits", "group", "sym"), LAYER_GRID)
def test_layer_through_kernels_equals_canonical(
    layout: str, backend: str, bits: int, group: int, sym: bool, *, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variant through the kernels (forced on: 8-bit routes are not in the defaults),
    one launch per projection, the canonical route's bytes."""
    launched = _counting_launches(monkeypatch)
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
    got = direct.try_direct(
        layout, on_device, quant, backend, num_experts=E, gated=gated, kernels=True
    )
    assert got is not None
    assert len(launched) == 2
    want = canonical(layout, tensors, quant, backend, num_experts=E, gated=gated)
    _same(ConvertedLayer({n: t.cpu() for n, t in got.tensors.items()}, got.descriptor), want)


def test_cpu_default_keeps_the_torch_transforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the device in KERNEL_DEVICES (a plain CPU run) no kernel is called, even
    when asked for."""
    monkeypatch.setattr(gpu_repack, "KERNEL_DEVICES", {"cuda"})
    calls: list[str] = []
    monkeypatch.setattr(gpu_repack, "_launch", lambda *a: calls.append("kernel"))
    tensors, quant = _checkpoint("gptq")
    got = direct.try_direct("gptq", tensors, quant, "MARLIN", num_experts=E, kernels=True)
    assert got is not None and calls == []


def _counting_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The slab count of every kernel launch from now on (the launches still run)."""
    launched: list[int] = []
    real = gpu_repack._launch

    def counted(repack: object, head: object, sources: list[object], targets: object) -> None:
        launched.append(len(sources))
        real(repack, head, sources, targets)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu_repack, "_launch", counted)
    return launched


def test_kernel_defaults_are_a_per_route_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernels=None` takes the kernel only for routes in `KERNEL_DEFAULTS`; a layer then
    costs one launch per projection (every expert, gate and up: 2 x E slabs for w13, E for
    w2), with the canonical route's bytes."""
    launched = _counting_launches(monkeypatch)
    tensors, quant = _checkpoint("gptq", group=128)
    want = canonical("gptq", tensors, quant, "MARLIN", num_experts=E)
    monkeypatch.setattr(direct, "KERNEL_DEFAULTS", frozenset())
    _same(direct.try_direct("gptq", tensors, quant, "MARLIN", num_experts=E), want)
    assert launched == []
    monkeypatch.setattr(direct, "KERNEL_DEFAULTS", frozenset({("gptq", "MARLIN", 4)}))
    _same(direct.try_direct("gptq", tensors, quant, "MARLIN", num_experts=E), want)
    assert launched == [2 * E, E]
    launched.clear()
    direct.try_direct("gptq", tensors, quant, "TRITON", num_experts=E)
    direct.try_direct("gptq", tensors, quant, "MARLIN", num_experts=E, kernels=False)
    assert launched == []


def test_experts_that_differ_are_cut_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_experts` cuts only expert 0's views; an expert stored otherwise (here: a
    transposed copy, same shape, not contiguous) sends the projection down `run`, which
    makes each tensor contiguous and still converts the layer in one launch."""
    launched = _counting_launches(monkeypatch)
    tensors, quant = _checkpoint("gptq", group=128)
    want = canonical("gptq", tensors, quant, "TRITON", num_experts=E)
    stored = tensors["1.w2.qweight"]
    tensors["1.w2.qweight"] = stored.t().contiguous().t()  # the same words, column-major
    assert not tensors["1.w2.qweight"].is_contiguous()
    calls: list[bool] = []
    real = gpu_repack.Repack.run_experts

    def spy(self: gpu_repack.Repack, *args: object) -> bool:
        done = real(self, *args)  # type: ignore[arg-type]
        calls.append(done)
        return done

    monkeypatch.setattr(gpu_repack.Repack, "run_experts", spy)
    got = direct.try_direct("gptq", tensors, quant, "TRITON", num_experts=E, kernels=True)
    assert got is not None
    _same(got, want)
    assert calls == [True, False]
    assert launched == [2 * E, E]


@pytest.mark.parametrize(("layout", "backend", "bits"), KERNEL_ROUTES)
def test_run_over_mixed_slabs(
    layout: str, backend: str, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Repack.run` on tensors of one shape launches once, on tensors of different shapes
    once per tensor; either way each output is the torch transform's."""
    launched = _counting_launches(monkeypatch)
    n, k = SHAPES[(layout, backend)][-1]
    sizes = [(n, k), (n, k), (n, 2 * k)]  # the last: another shape
    route = direct.ROUTES[(layout, backend)]
    kernel = route.kernels[bits]
    assert isinstance(kernel, gpu_repack.Repack)
    for shapes, launches in ((sizes[:2], [2]), (sizes, [1, 1, 1])):
        pairs, want = [], []
        for seed, (ni, ki) in enumerate(shapes):
            stored, _, out = _stored_and_out(layout, backend, bits, n=ni, k=ki, seed=seed)
            reference = torch.full_like(out, 0x5A)
            route.weight[bits](stored, route.target.rows(reference[0], 0, ni, bits), bits)
            out.fill_(0x5A)
            pairs.append((stored, route.target.rows(out[0], 0, ni, bits)))
            want.append((out, reference))
        launched.clear()
        kernel.run(pairs, bits)
        assert launched == launches
        for got, reference in want:
            assert torch.equal(got.view(torch.uint8), reference.view(torch.uint8))


#: The kernels' parameters a launch at Mixtral's size specializes as multiples of 16 (fresh
#: allocations, strides and tile counts of 16 k) - what lets the compiler vectorize. The
#: slab pointers are read from `ptrs`; their alignment is the ALIGNED constexpr.
ALIGNED = (
    "ptrs",
    "table",
    "src_stride",
    "dst_stride",
    "tile_rows",
    "tile_cols",
    "rows",
    "cols",
    "kw_count",
    "nw_count",
    "kt_count",
    "nt_count",
)


def _launched_variants() -> dict[tuple[str, str], list[tuple[str, str, int]]]:
    """Each distinct (kernel kind, constexprs as JSON) `gpu_repack._launch` uses -> the
    routes (layout, backend, bits) that launch it."""
    found: dict[tuple[str, str], list[tuple[str, str, int]]] = {}
    for layout, backend, bits in KERNEL_ROUTES:
        kernel = _kernel_of(layout, backend, bits)
        consts = json.dumps(gpu_repack.launch_constexprs(kernel), sort_keys=True)
        found.setdefault((kernel.kind, consts), []).append((layout, backend, bits))
    return found


def test_launches_are_powers_of_two() -> None:
    """Block sizes are powers of two (the kernels' index arithmetic is shifts and masks),
    the hot routes take their own kernels (int8 Marlin the table kernel)."""
    for consts, routes in _launched_variants().items():
        for name, value in json.loads(consts[1]).items():
            if name.startswith("B"):
                assert value & (value - 1) == 0, (routes, name, value)
    kinds = {route: _kernel_of(*route).kind for route in KERNEL_ROUTES}
    assert kinds[("gptq", "TRITON", 4)] == "transpose"
    assert kinds[("awq", "TRITON", 4)] == "awq_triton"
    assert kinds[("gptq", "MARLIN", 4)] == kinds[("gptq", "BATCHED_MARLIN", 4)] == "marlin4_gptq"
    assert kinds[("awq", "MARLIN", 4)] == kinds[("awq", "BATCHED_MARLIN", 4)] == "marlin4_awq"
    assert kinds[("gptq", "MARLIN", 8)] == "table"


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_kernels_compile_for_sm90(aligned: bool) -> None:
    """Every route's kernel, with the constexprs and argument types its launch uses,
    compiles for sm_90a (no GPU needed). Aligned as at Mixtral's size, the word transpose,
    the AWQ -> TRITON kernel and the int4 Marlin kernels load int32 vectors (x 4, x 2),
    store int32 x 4 and touch no scalar word, and the table kernel stores int32 x 4 (its
    loads are gathers through the table)."""
    variants = _launched_variants()
    by_kind: dict[str, list[tuple[dict[str, object], list[tuple[str, str, int]]]]] = {}
    for (kind, consts), routes in variants.items():
        loaded = {**json.loads(consts), "ALIGNED": aligned}
        by_kind.setdefault(kind, []).append((loaded, routes))
    launched: list[tuple[str, str, int]] = []
    for kind, entries in sorted(by_kind.items()):
        asm = compiled_asm(
            "service.formats.routes.gpu_repack_kernel",
            gpu_repack.KERNEL_NAMES[kind],
            [consts for consts, _ in entries],
            types={"ptrs": "*i64", "table": "*i32"},
            options={"num_warps": gpu_repack.NUM_WARPS},
            aligned=ALIGNED if aligned else (),
        )
        for (_, routes), compiled in zip(entries, asm, strict=True):
            launched += routes
            ops = Counter(re.findall(r"\b(ld|st)\.global(\.v\d)?\.b32\b", compiled["ptx"]))
            assert ops[("ld", "")] + ops[("ld", ".v2")] + ops[("ld", ".v4")] > 0, routes
            if not aligned:
                continue
            if kind != "table":
                assert ops[("ld", ".v2")] + ops[("ld", ".v4")] and ops[("st", ".v4")], (routes, ops)
                assert not ops[("ld", "")] and not ops[("st", "")], (routes, ops)
            else:
                assert ops[("st", ".v4")] and not ops[("st", "")], (routes, ops)
    assert sorted(launched) == sorted(KERNEL_ROUTES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("layout", "backend", "bits"), KERNEL_ROUTES)
def test_kernel_at_mixtral_size(layout: str, backend: str, bits: int) -> None:
    """w13 of one Mixtral-8x7B expert (N = 2 x 14336, K = 4096) and its w2 shape."""
    _both(layout, backend, bits, n=28672, k=4096, seed=1)
    _both(layout, backend, bits, n=4096, k=14336, seed=2)
