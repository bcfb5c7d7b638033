"""Repack variants only the benchmarks run: the generic table kernels, torch.compile'd
transforms, and the canonical route for a whole checkpoint.

The package keeps the routes it takes (service/formats/routes/direct.py); the benchmarks
time them against what they replaced or might replace:

* `TABLE_KERNELS`: the int4 Marlin routes' generic table kernel (one gathered input word
  per nibble field), which the dedicated int4 kernels in `direct.ROUTES` replaced;
* `compiled`: a route's torch transform through torch.compile (inductor fuses the nibble
  exchange and the byte move into one kernel on a GPU; eagerly they are several passes);
* `table_weights` / `compiled_weights`: `direct.try_route` weight choices that take them,
  and `try_table` / `try_compiled`, `try_direct` with those choices;
* `canonical_converter`: the whole-checkpoint converter on the canonical route alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from service.formats.checkpoint.converter import Converter, route_converter
from service.formats.checkpoint.plan import CheckpointJob
from service.formats.routes import gpu_repack
from service.formats.routes.canonical import canonical
from service.formats.routes.direct import Route, WeightChoice, route_kernel, try_route
from service.formats.routes.targets import MARLIN
from service.formats.routes.transforms import WeightFn, marlin4_from_awq, marlin4_from_gptq
from service.formats.writers import ConvertedLayer

__all__ = [
    "TABLE_KERNELS",
    "canonical_converter",
    "compiled",
    "compiled_weights",
    "table_weights",
    "try_compiled",
    "try_table",
]

_GPTQ_MARLIN_TABLE = {
    4: route_kernel("gptq", MARLIN, marlin4_from_gptq, 4, in_tile=(2, 64), out_tile=(1, 128))
}
_AWQ_MARLIN_TABLE = {
    4: route_kernel("awq", MARLIN, marlin4_from_awq, 4, in_tile=(16, 8), out_tile=(1, 128))
}

TABLE_KERNELS: Mapping[tuple[str, str], Mapping[int, WeightFn]] = {
    ("gptq", "MARLIN"): _GPTQ_MARLIN_TABLE,
    ("gptq", "BATCHED_MARLIN"): _GPTQ_MARLIN_TABLE,
    ("awq", "MARLIN"): _AWQ_MARLIN_TABLE,
    ("awq", "BATCHED_MARLIN"): _AWQ_MARLIN_TABLE,
}
"""The Marlin routes' generic table kernels, which the dedicated int4 kernels replaced (the
bench's `table` route times them against each other)."""

_COMPILED: dict[WeightFn, WeightFn] = {}


def compiled(fn: WeightFn) -> WeightFn:
    """`fn` through torch.compile. Compiled once per transform, then once per tensor shape
    by torch's own guards."""
    found = _COMPILED.get(fn)
    if found is None:
        found = _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return found


def table_weights(layout: str, backend: str) -> WeightChoice:
    """The route's kernels with `TABLE_KERNELS` taking precedence, where a device takes
    kernels; the torch transform elsewhere."""

    def choose(route: Route, bits: int, device: torch.device) -> WeightFn:
        fn = route.weight[bits]
        if not gpu_repack.usable(device):
            return fn
        table = TABLE_KERNELS.get((layout, backend), {})
        return table.get(bits) or route.kernels.get(bits, fn)

    return choose


def compiled_weights(route: Route, bits: int, device: torch.device) -> WeightFn:
    """The route's torch transform through torch.compile (never a kernel)."""
    return compiled(route.weight[bits])


def try_table(
    layout: str, tensors: Mapping[str, torch.Tensor], quant: Any, backend: str, **kw: Any
) -> ConvertedLayer | None:
    """`direct.try_direct` with the table kernels (see `table_weights`)."""
    return try_route(layout, tensors, quant, backend, weights=table_weights(layout, backend), **kw)


def try_compiled(
    layout: str, tensors: Mapping[str, torch.Tensor], quant: Any, backend: str, **kw: Any
) -> ConvertedLayer | None:
    """`direct.try_direct` with torch.compile'd transforms."""
    return try_route(layout, tensors, quant, backend, weights=compiled_weights, **kw)


def canonical_converter(job: CheckpointJob) -> Converter:
    """The whole-checkpoint converter on the canonical route (the before of the bench's
    before/after)."""
    return route_converter(job, canonical)
