"""Converted layers a worker keeps loaded (ConvertWeights with keep_loaded) for RunMoE.

Each has an id the summary returns, its kernel-format tensors on the worker's device, the
format descriptor and the layer's shape; ListLayers shows `info` (LayerInfo in proto JSON
field names), UnloadLayer drops the tensors.

Device memory is the scarce thing, so the store holds layers against a byte budget: adding
a layer evicts the least recently used ones until it fits (a RunMoE on a layer counts as a
use), and a layer larger than the whole budget is refused (`LayerBudgetError`) rather than
emptying the store for nothing. The kernel backend that runs a layer is prepared once, on
first use, and kept with the layer, so repeated forwards pay no preparation.

Conversion jobs and forwards touch the store from their own threads, so it is locked; the
order of the dict is the recency order (oldest first).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from service.worker.errors import LayerBudgetError


@dataclass
class LoadedLayer:
    layer_id: str
    #: LayerInfo as JSON (proto field names), without worker_index (the server adds it).
    info: dict[str, Any]
    #: Kernel-format tensors by name (torch tensors on the worker's device).
    tensors: dict[str, Any] = field(default_factory=dict)
    #: The deployment spec JSON the layer was converted for (shape, activation, routing).
    deployment: dict[str, Any] = field(default_factory=dict)
    #: The prepared kernel backend (an ExpertsBackend), made on first use; see `backend_for`.
    backend: Any = None
    #: Guards the one-time preparation of `backend`.
    prepare_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    last_used: float = field(default_factory=time.time)

    @property
    def byte_size(self) -> int:
        return int(self.info.get("byte_size", 0))

    def backend_for(self, make: Callable[[LoadedLayer], Any]) -> Any:
        """The layer's prepared backend, made by `make(self)` the first time only."""
        with self.prepare_lock:
            if self.backend is None:
                self.backend = make(self)
            return self.backend

    def listed(self) -> dict[str, Any]:
        """`info` with the time of last use (ListLayers)."""
        stamp = datetime.fromtimestamp(self.last_used, UTC)
        return {**self.info, "last_used_time": stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}


def new_layer_id() -> str:
    return f"layer-{secrets.token_hex(8)}"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LayerStore:
    """Layers by id, least recently used first, held to `budget_bytes` (0: no limit)."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self._lock = threading.Lock()
        self._layers: OrderedDict[str, LoadedLayer] = OrderedDict()
        self.budget_bytes = budget_bytes
        #: Ids evicted to make room, oldest first (kept short: for logs and tests).
        self.evicted: list[str] = []

    def add(self, layer: LoadedLayer, *, budget_bytes: int | None = None) -> list[str]:
        """Keep `layer`, evicting least recently used layers until it fits; returns the
        evicted ids. `budget_bytes` (when given) replaces the store's budget first: the
        server sends its setting with each call, so the worker needs no configuration."""
        with self._lock:
            if budget_bytes is not None:
                self.budget_bytes = budget_bytes
            budget = self.budget_bytes
            if budget and layer.byte_size > budget:
                raise LayerBudgetError(layer.byte_size, budget)
            evicted: list[str] = []
            used = sum(item.byte_size for item in self._layers.values())
            while budget and self._layers and used + layer.byte_size > budget:
                old_id, old = self._layers.popitem(last=False)
                used -= old.byte_size
                evicted.append(old_id)
            self._layers[layer.layer_id] = layer
            layer.last_used = time.time()
            self.evicted = (self.evicted + evicted)[-64:]
            return evicted

    def get(self, layer_id: str) -> LoadedLayer | None:
        """The layer without counting a use (tests, listings)."""
        with self._lock:
            return self._layers.get(layer_id)

    def use(self, layer_id: str) -> LoadedLayer | None:
        """The layer, marked most recently used (a forward is about to run on it)."""
        with self._lock:
            layer = self._layers.get(layer_id)
            if layer is not None:
                self._layers.move_to_end(layer_id)
                layer.last_used = time.time()
            return layer

    def pop(self, layer_id: str) -> LoadedLayer | None:
        with self._lock:
            return self._layers.pop(layer_id, None)

    def infos(self) -> list[dict[str, Any]]:
        with self._lock:
            return [layer.listed() for layer in self._layers.values()]

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(layer.byte_size for layer in self._layers.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._layers)
