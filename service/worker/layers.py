"""Converted layers a worker keeps loaded (ConvertWeights with keep_loaded) for RunMoE.

Each has an id the summary returns, its kernel-format tensors on the worker's device, the
format descriptor and the layer's shape; ListLayers shows `info` (LayerInfo in proto JSON
field names), UnloadLayer drops the tensors. Conversion jobs add layers from their threads,
so the store is locked.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


@dataclass
class LoadedLayer:
    layer_id: str
    #: LayerInfo as JSON (proto field names), without worker_index (the server adds it).
    info: dict[str, Any]
    #: Kernel-format tensors by name (torch tensors on the worker's device).
    tensors: dict[str, Any] = field(default_factory=dict)
    #: The deployment spec JSON the layer was converted for (shape, activation, routing).
    deployment: dict[str, Any] = field(default_factory=dict)


def new_layer_id() -> str:
    return f"layer-{secrets.token_hex(8)}"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LayerStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layers: dict[str, LoadedLayer] = {}

    def add(self, layer: LoadedLayer) -> None:
        with self._lock:
            self._layers[layer.layer_id] = layer

    def get(self, layer_id: str) -> LoadedLayer | None:
        with self._lock:
            return self._layers.get(layer_id)

    def pop(self, layer_id: str) -> LoadedLayer | None:
        with self._lock:
            return self._layers.pop(layer_id, None)

    def infos(self) -> list[dict[str, Any]]:
        with self._lock:
            return [layer.info for layer in self._layers.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._layers)
