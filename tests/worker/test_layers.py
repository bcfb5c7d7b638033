"""The worker's layer registry: byte budget, least-recently-used eviction, listing, and the
backend prepared once per layer."""

from __future__ import annotations

import threading

import pytest

from service.worker.errors import LayerBudgetError
from service.worker.layers import LayerStore, LoadedLayer


def layer(layer_id: str, size: int) -> LoadedLayer:
    info = {"layer_id": layer_id, "byte_size": size, "format": {"backend": "TRITON"}}
    return LoadedLayer(layer_id, info)


def test_evicts_least_recently_used_to_fit() -> None:
    store = LayerStore(budget_bytes=300)
    assert store.add(layer("a", 100)) == []
    assert store.add(layer("b", 100)) == []
    assert store.add(layer("c", 100)) == []
    assert store.use("a") is not None  # a is now the most recent; b the least
    assert store.add(layer("d", 150)) == ["b", "c"]
    assert [i["layer_id"] for i in store.infos()] == ["a", "d"]
    assert store.used_bytes == 250
    assert store.evicted == ["b", "c"]


def test_get_does_not_count_as_use() -> None:
    store = LayerStore(budget_bytes=200)
    store.add(layer("a", 100))
    store.add(layer("b", 100))
    assert store.get("a") is not None
    assert store.add(layer("c", 100)) == ["a"]


def test_layer_larger_than_the_budget_is_refused_and_evicts_nothing() -> None:
    store = LayerStore(budget_bytes=100)
    store.add(layer("a", 60))
    with pytest.raises(LayerBudgetError) as caught:
        store.add(layer("big", 101))
    assert caught.value.field == "layer_budget" and "101" in str(caught.value)
    assert [i["layer_id"] for i in store.infos()] == ["a"]


def test_budget_zero_is_unlimited_and_call_budget_replaces_it() -> None:
    store = LayerStore()
    for n in range(5):
        store.add(layer(str(n), 1 << 30))
    assert len(store) == 5
    assert store.add(layer("x", 10), budget_bytes=(1 << 30) + 10) == ["0", "1", "2", "3"]
    assert store.budget_bytes == (1 << 30) + 10


def test_listing_has_last_used_time_and_pop_frees() -> None:
    store = LayerStore()
    store.add(layer("a", 5))
    (info,) = store.infos()
    assert info["last_used_time"].endswith("Z") and info["byte_size"] == 5
    popped = store.pop("a")
    assert popped is not None and popped.byte_size == 5
    assert store.pop("a") is None and store.use("a") is None


def test_backend_prepared_once_across_threads() -> None:
    made: list[int] = []
    item = layer("a", 1)
    barrier = threading.Barrier(8)

    def make(_: LoadedLayer) -> object:
        made.append(1)
        return object()

    results: list[object] = []

    def worker() -> None:
        barrier.wait()
        results.append(item.backend_for(make))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len({id(r) for r in results}) == 1
