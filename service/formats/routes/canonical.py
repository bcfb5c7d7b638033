"""The canonical route: reader -> canonical layer -> writer.

General (every layout the readers know, every backend with a writer) and the exactness
reference every direct route is checked against, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from service.formats import registry
from service.formats.canonical import QuantizedMoELayer
from service.formats.readers.layouts import SourceQuantization
from service.formats.writers import DEFAULT_OPTIONS, ConversionOptions, ConvertedLayer

__all__ = ["canonical"]


def canonical(
    layout: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization,
    backend: str,
    *,
    num_experts: int,
    gated: bool = True,
    options: ConversionOptions = DEFAULT_OPTIONS,
    check: Callable[[QuantizedMoELayer], None] | None = None,
) -> ConvertedLayer:
    """The general route: reader -> canonical layer -> writer (`check` as `try_direct`'s)."""
    layer = registry.read_layer(layout, tensors, quant, num_experts=num_experts, gated=gated)
    if check is not None:
        check(layer)
    return registry.convert(layer, backend, source=layout, options=options)
