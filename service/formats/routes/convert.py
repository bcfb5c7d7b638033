"""One layer's conversion, by whichever route fits: direct where one covers the layer.

`convert` is what the inline path and the whole-checkpoint job call: per-expert checkpoint
tensors -> a backend's tensors, the same bytes whichever route runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from service.formats.canonical import QuantizedMoELayer
from service.formats.readers.layouts import SourceQuantization
from service.formats.routes.canonical import canonical
from service.formats.routes.direct import try_direct
from service.formats.routes.packed import PackedLayer
from service.formats.writers import DEFAULT_OPTIONS, ConversionOptions, ConvertedLayer

__all__ = ["convert"]


def convert(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    check: Callable[[PackedLayer | QuantizedMoELayer], None] | None = None,
) -> ConvertedLayer:
    """Per-expert checkpoint tensors -> `backend`'s tensors: a direct route when `ROUTES`
    has one that fits the layer, else the canonical route. Same bytes either way. `check`
    sees the layer read (packed or canonical) before anything is written, and may raise."""
    route = try_direct(
        layout,
        tensors,
        quant,
        backend,
        num_experts=num_experts,
        gated=gated,
        options=options,
        check=check,
    )
    if route is not None:
        return route
    return canonical(
        layout,
        tensors,
        quant,
        backend,
        num_experts=num_experts,
        gated=gated,
        options=options,
        check=check,
    )
