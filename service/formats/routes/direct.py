"""Direct packed -> packed conversions for the hot (source layout, backend) routes.

The canonical route (reader -> one byte per code -> writer) is general and is the exactness
reference, but for a 4-bit layer it writes and re-reads twice the checkpoint's bytes in
codes, stacks and concatenates them, and checks every code's range: many times the memory
traffic of the conversion itself. A direct route never expands the weight: it reads the
layer packed (`read.read_packed`), writes each expert's weight straight into its rows of
the output (`transforms`, or the fused Triton kernels of `gpu_repack` on a GPU), and takes
everything else through the canonical helpers (`targets`).

`ROUTES` is the dispatch table: (layout, backend) -> the weight transform, plus what that
transform assumes. `try_direct` answers None for a layer a route does not cover
(act-order, Marlin padding, 8-bit activations, AWQ int8...) and for any malformed input,
which then takes the canonical route (`routes.convert`), so its error comes from the
canonical reader, word for word; both routes give byte-identical tensors
(tests/formats/routes/test_direct.py checks every variant).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from service.formats import registry
from service.formats.errors import FormatError
from service.formats.readers.layouts import LAYOUTS, SourceQuantization
from service.formats.routes import gpu_repack
from service.formats.routes.packed import PackedLayer, PackedProjection
from service.formats.routes.read import read_packed
from service.formats.routes.targets import MARLIN, TRITON, WeightTarget
from service.formats.routes.transforms import (
    WeightFn,
    marlin4_from_awq,
    marlin4_from_ct,
    marlin4_from_gptq,
    marlin8_from_ct,
    marlin8_from_gptq,
    triton_from_awq,
    triton_from_k_first,
    triton_from_n_first,
)
from service.formats.writers import (
    DEFAULT_OPTIONS,
    ConversionOptions,
    ConvertedLayer,
    finish,
    weight_type,
)

__all__ = [
    "KERNEL_DEFAULTS",
    "ROUTES",
    "Route",
    "WeightChoice",
    "default_weights",
    "direct_route",
    "route_kernel",
    "try_direct",
    "try_route",
    "write_weight",
]


@dataclass(frozen=True)
class Route:
    """A direct route: the target, the weight transform by bit width (absent widths take
    the canonical route), and the fused Triton kernels that replace those transforms on a
    device `gpu_repack.usable` accepts (absent widths keep the torch transform)."""

    target: WeightTarget
    weight: Mapping[int, WeightFn]
    kernels: Mapping[int, WeightFn] = dataclasses.field(default_factory=dict)


def route_kernel(
    layout: str,
    target: WeightTarget,
    fn: WeightFn,
    bits: int,
    *,
    in_tile: tuple[int, int],
    out_tile: tuple[int, int],
    kind: str = "table",
) -> gpu_repack.Repack:
    """`fn` as one Triton kernel; its permutation is read off `fn` itself (run on a probe
    of one expert's stored words, into the target's word matrix)."""

    def probe(stored: torch.Tensor, probe_bits: int) -> torch.Tensor:
        n, k = LAYOUTS[layout].dims_from_weight(tuple(stored.shape), probe_bits, "probe")
        out_e = target.allocate(1, n, k, probe_bits, stored.device)[0]
        fn(stored, target.rows(out_e, 0, n, probe_bits), probe_bits)
        return out_e.view(torch.int32).view(int(out_e.shape[0]), -1)

    return gpu_repack.Repack(fn, probe, bits, in_tile, out_tile, kind=kind)


# Tiles in int32 words, [rows, columns] of the stored tensor -> of the output word matrix:
# Marlin: one 16 x 64 tile (16 * bits words) per k tile and n tile; TRITON: a transpose of
# words (GPTQ) or of 8 x 8 code blocks (AWQ: 8 rows of one word -> 8 rows of one word).
# Int4 Marlin has dedicated kernels (coalesced block loads, constant shifts); int8 Marlin
# takes the generic table kernel (one gathered word per nibble field).
_GPTQ_MARLIN = {
    4: route_kernel(
        "gptq",
        MARLIN,
        marlin4_from_gptq,
        4,
        in_tile=(2, 64),
        out_tile=(1, 128),
        kind="marlin4_gptq",
    ),
    8: route_kernel("gptq", MARLIN, marlin8_from_gptq, 8, in_tile=(4, 64), out_tile=(1, 256)),
}
_AWQ_MARLIN = {
    4: route_kernel(
        "awq", MARLIN, marlin4_from_awq, 4, in_tile=(16, 8), out_tile=(1, 128), kind="marlin4_awq"
    )
}


_GPTQ_TRITON = {
    bits: route_kernel(
        "gptq",
        TRITON,
        triton_from_k_first,
        bits,
        in_tile=(1, 1),
        out_tile=(1, 1),
        kind="transpose",
    )
    for bits in (4, 8)
}


_AWQ_TRITON = {
    4: route_kernel(
        "awq", TRITON, triton_from_awq, 4, in_tile=(8, 1), out_tile=(8, 1), kind="awq_triton"
    )
}


ROUTES: Mapping[tuple[str, str], Route] = {
    ("gptq", "TRITON"): Route(
        TRITON, {4: triton_from_k_first, 8: triton_from_k_first}, _GPTQ_TRITON
    ),
    ("awq", "TRITON"): Route(TRITON, {4: triton_from_awq}, _AWQ_TRITON),
    ("compressed-tensors", "TRITON"): Route(
        TRITON, {4: triton_from_n_first, 8: triton_from_n_first}
    ),
    ("moe_wna16", "TRITON"): Route(TRITON, {4: triton_from_n_first, 8: triton_from_n_first}),
    ("gptq", "MARLIN"): Route(MARLIN, {4: marlin4_from_gptq, 8: marlin8_from_gptq}, _GPTQ_MARLIN),
    ("awq", "MARLIN"): Route(MARLIN, {4: marlin4_from_awq}, _AWQ_MARLIN),
    ("compressed-tensors", "MARLIN"): Route(MARLIN, {4: marlin4_from_ct, 8: marlin8_from_ct}),
    ("gptq", "BATCHED_MARLIN"): Route(
        MARLIN, {4: marlin4_from_gptq, 8: marlin8_from_gptq}, _GPTQ_MARLIN
    ),
    ("awq", "BATCHED_MARLIN"): Route(MARLIN, {4: marlin4_from_awq}, _AWQ_MARLIN),
    ("compressed-tensors", "BATCHED_MARLIN"): Route(
        MARLIN, {4: marlin4_from_ct, 8: marlin8_from_ct}
    ),
}
"""(source layout, backend) -> direct route. Absent pairs take the canonical route."""


KERNEL_DEFAULTS: frozenset[tuple[str, str, int]] = frozenset(
    {
        ("gptq", "TRITON", 4),
        ("gptq", "MARLIN", 4),
        ("gptq", "BATCHED_MARLIN", 4),
        ("awq", "TRITON", 4),
        ("awq", "MARLIN", 4),
        ("awq", "BATCHED_MARLIN", 4),
    }
)
"""(layout, backend, bits) whose fused Triton kernels replace the torch transforms by
default (`try_direct(kernels=None)`) on a device `gpu_repack.usable` accepts: the routes
an H200 run showed faster with the kernel (bench/convert_bench.py's `direct` and `triton`
routes; the figures are in bench/RESULTS.md). BATCHED_MARLIN writes MARLIN's weight with
the same transform and kernel. The 8-bit kernels stay off until an H200 run times them."""


def write_weight(
    route: Route,
    fn: WeightFn,
    projection: PackedProjection,
    device: torch.device,
) -> torch.Tensor:
    """`projection`'s weight written by `fn` into a fresh target weight on `device`."""
    bits = projection.bits
    out = route.target.allocate(projection.num_experts, projection.n, projection.k, bits, device)
    if isinstance(fn, gpu_repack.Repack) and _run_experts(route, fn, projection, out, device):
        return out
    pairs = []
    for expert, shards in enumerate(projection.weights):
        start = 0
        rows = projection.n // len(shards)
        for stored in shards:
            view = route.target.rows(out[expert], start, start + rows, bits)
            pairs.append((stored.to(device), view))
            start += rows
    if isinstance(fn, gpu_repack.Repack):
        fn.run(pairs, bits)  # one launch when every pair has one shape
    else:
        for stored, view in pairs:
            fn(stored, view, bits)
    return out


def _run_experts(
    route: Route,
    kernel: gpu_repack.Repack,
    projection: PackedProjection,
    out: torch.Tensor,
    device: torch.device,
) -> bool:
    """Every expert and shard of `projection` in one kernel launch, only expert 0's output
    views cut (expert e's are the same views e experts further on); False when the
    experts differ in shards or shapes (the caller then cuts every view)."""
    shards = len(projection.weights[0])
    rows = projection.n // shards
    bits = projection.bits
    views = [route.target.rows(out[0], i * rows, (i + 1) * rows, bits) for i in range(shards)]
    stored = [[t.to(device) for t in expert] for expert in projection.weights]
    return kernel.run_experts(stored, views, int(out.stride(0)) * out.element_size(), bits)


def direct_route(layout: str, backend: str, bits: int) -> tuple[Route, WeightFn] | None:
    route = ROUTES.get((layout, backend))
    fn = None if route is None else route.weight.get(bits)
    return None if route is None or fn is None else (route, fn)


WeightChoice = Callable[[Route, int, torch.device], WeightFn]
"""Which weight transform a route runs for `bits` on `device` (a direct route's torch
transform, `Route.weight[bits]`, or one of its kernels)."""


def default_weights(layout: str, backend: str, kernels: bool | None) -> WeightChoice:
    """`try_direct`'s choice: on a device `gpu_repack.usable` accepts, the route's fused
    Triton kernel where it has one, if `kernels` (None: if `KERNEL_DEFAULTS` lists the
    route); the torch transform otherwise."""

    def choose(route: Route, bits: int, device: torch.device) -> WeightFn:
        fn = route.weight[bits]
        wanted = (layout, backend, bits) in KERNEL_DEFAULTS if kernels is None else kernels
        if wanted and gpu_repack.usable(device):
            return route.kernels.get(bits, fn)
        return fn

    return choose


def try_direct(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    kernels: bool | None = None,
    check: Callable[[PackedLayer], None] | None = None,
    defer_checks: bool = True,
) -> ConvertedLayer | None:
    """The direct route's result, or None when there is none for this layer (or the input
    is malformed: the canonical reader then says how). `kernels`: on a device
    `gpu_repack.usable` accepts, the route's fused Triton kernels replace its torch
    transforms (True), or not (False); None (the default) takes them for the routes in
    `KERNEL_DEFAULTS`. `defer_checks` and `check` as `try_route`'s."""
    return try_route(
        layout,
        tensors,
        quant,
        backend,
        num_experts=num_experts,
        gated=gated,
        options=options,
        weights=default_weights(layout, backend, kernels),
        check=check,
        defer_checks=defer_checks,
    )


def try_route(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    weights: WeightChoice,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    check: Callable[[PackedLayer], None] | None = None,
    defer_checks: bool = True,
) -> ConvertedLayer | None:
    """`try_direct` with the weight transform picked by `weights`.
    `defer_checks`: `read_packed`'s content checks are waited for after the weights are
    queued (see its `deferred`); False waits for them before anything is written.
    `check` sees the layer as read, before anything is written (the inline path's
    declared-shape check)."""
    found = direct_route(layout, backend, quant.bits)
    if found is None or layout not in LAYOUTS:
        return None
    route = found[0]
    registry.writer_for(backend)
    deferred: list[Callable[[], bool]] | None = [] if defer_checks else None
    try:
        packed = read_packed(
            LAYOUTS[layout], tensors, quant, num_experts=num_experts, gated=gated, deferred=deferred
        )
    except FormatError:
        return None
    if check is not None:
        check(packed)
    if not route.target.applies(packed, options):
        return None
    device = packed.w13.device
    fn = weights(route, quant.bits, device)
    w13 = write_weight(route, fn, packed.w13, device)
    w2 = write_weight(route, fn, packed.w2, device)
    named = route.target.tensors(packed, w13, w2)
    if deferred and not all(holds() for holds in deferred):
        # A content check failed: what was written is dropped, and the layer is read the
        # general way (which refuses it, or accepts it as, say, asymmetric).
        return try_route(
            layout,
            tensors,
            quant,
            backend,
            num_experts=num_experts,
            gated=gated,
            options=options,
            weights=weights,
            check=check,
            defer_checks=False,
        )
    return finish(
        named,
        backend=backend,
        source=layout,
        layer=packed,
        weight_type_name=weight_type(packed.w13),
        options=options,
    )
