"""The layer directory: where kept layers live, what a worker's listing prunes, why a lost
layer is gone (remembered, bounded)."""

from __future__ import annotations

import pytest

from service.pool import layers
from service.pool.layers import LayerDirectory, LayerPlace


def test_a_listing_prunes_that_workers_evicted_ids_and_adds_unknown_ones() -> None:
    directory = LayerDirectory()
    directory.remember("a", LayerPlace(0, 1, 10))
    directory.remember("b", LayerPlace(0, 1, 20))
    directory.remember("c", LayerPlace(1, 1, 30))
    directory.listed(0, 1, [{"layer_id": "b", "byte_size": 20}, {"layer_id": "d", "byte_size": 5}])
    assert directory.place("a") is None
    assert directory.place("d") == LayerPlace(0, 1, 5)
    assert directory.held_bytes() == {0: 25, 1: 30}


def test_a_restarted_workers_layers_are_lost_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(layers, "MAX_LOST_LAYERS", 2)
    directory = LayerDirectory()
    for name in ("a", "b", "c"):
        directory.remember(name, LayerPlace(0, 1, 1))
    directory.remember("kept", LayerPlace(1, 1, 1))
    directory.lose(0, "cuda:0", "killed by SIGKILL")
    assert directory.lost("a") is None  # the oldest explanation went first
    lost = directory.lost("c")
    assert lost is not None and lost.worker_index == 0 and "SIGKILL" in str(lost)
    assert directory.place("kept") == LayerPlace(1, 1, 1)
    directory.remember("c", LayerPlace(1, 2, 1))
    assert directory.lost("c") is None
