"""Where each kept layer lives: the server's directory of layers its workers hold.

Each kept layer's id maps to its worker and that worker's incarnation. A worker that
restarts loses its own layers only: their ids then explain which worker restarted and why
(`LayerLostError`), for a bounded while; the other workers' layers stay usable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from service.pool.errors import LayerLostError

#: Lost layer ids remembered for their explanation (oldest forgotten first).
MAX_LOST_LAYERS = 4096


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """Where a kept layer lives: its worker, that worker's incarnation, its size."""

    worker: int
    incarnation: int
    byte_size: int


class LayerDirectory:
    """Kept layer id -> its place; lost layer id -> why it is gone."""

    def __init__(self) -> None:
        self._places: dict[str, LayerPlace] = {}
        self._lost: OrderedDict[str, LayerLostError] = OrderedDict()

    def place(self, layer_id: str) -> LayerPlace | None:
        return self._places.get(layer_id)

    def lost(self, layer_id: str) -> LayerLostError | None:
        """Why a layer is gone, if its worker lost it in a restart not long ago."""
        return self._lost.get(layer_id)

    def remember(self, layer_id: str, place: LayerPlace) -> None:
        self._lost.pop(layer_id, None)
        self._places[layer_id] = place

    def forget(self, layer_id: str) -> None:
        self._places.pop(layer_id, None)

    def held_bytes(self) -> dict[int, int]:
        """Kept-layer bytes by worker index."""
        out: dict[int, int] = {}
        for place in self._places.values():
            out[place.worker] = out.get(place.worker, 0) + place.byte_size
        return out

    def listed(self, worker: int, incarnation: int, layers: Iterable[dict[str, Any]]) -> None:
        """What a worker listed it holds: ids of it no longer listed (evicted to make room)
        are dropped, ids listed but not known are added."""
        layers = list(layers)
        ids = {str(layer.get("layer_id")) for layer in layers}
        for layer_id, place in list(self._places.items()):
            if place.worker == worker and layer_id not in ids:
                del self._places[layer_id]
        for layer in layers:
            self._places.setdefault(
                str(layer.get("layer_id")),
                LayerPlace(worker, incarnation, int(layer.get("byte_size", 0))),
            )

    def lose(self, worker: int, device: str, reason: str) -> None:
        """A worker died: its layers are gone; remember why, for the callers that ask."""
        for layer_id, place in list(self._places.items()):
            if place.worker != worker:
                continue
            del self._places[layer_id]
            self._lost[layer_id] = LayerLostError(layer_id, worker, device, reason)
            while len(self._lost) > MAX_LOST_LAYERS:
                self._lost.popitem(last=False)
