"""SelectBackend in process: the answer cache, its invalidation and its metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from service.api.codecs import selection as codec
from service.api.codecs.answer_cache import MAX_KEY_BYTES, AnswerCache, CachedAnswer
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.servicer import SelectionServicer as Selection
from service.metrics import Metrics
from service.oracle import (
    PLATFORM_PRESETS,
    InvalidSpecError,
    PlatformProfile,
    SelectionError,
    select,
)
from service.worker.errors import WorkerNotFoundError, WorkerUnavailableError

LAYER = {"num_experts": 64, "top_k": 6, "hidden_size": 2048, "intermediate_size": 1408}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


class Platforms:
    """A PlatformSource with one worker whose profile the test changes."""

    def __init__(self, profile: PlatformProfile | None) -> None:
        self._profile = profile
        self.generation = 0

    def set(self, profile: PlatformProfile | None) -> None:
        self._profile = profile
        self.generation += 1

    def profile(self, index: int) -> PlatformProfile:
        if index != 0:
            raise WorkerNotFoundError(index, 1)
        if self._profile is None:
            raise WorkerUnavailableError("worker 0 is starting")
        return self._profile

    def default_profile(self) -> PlatformProfile | None:
        return self._profile


def request_bytes(**spec: Any) -> bytes:
    body = {"hf_quantization_config": GPTQ, "layer": LAYER, **spec}
    return pb.SelectBackendRequest(spec_json=json.dumps(body)).SerializeToString()


def ask(selection: Selection, data: bytes) -> pb.SelectBackendResponse:
    payload = asyncio.run(selection.select_backend_bytes(data, None))
    return pb.SelectBackendResponse.FromString(payload)


def selections(metrics: Metrics) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for family in metrics.registry.collect():
        if family.name == "moe_control_backend_selections":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["backend"], sample.labels["integration"])
                    out[key] = sample.value
    return out


def test_repeated_requests_are_answered_from_the_cache_and_still_counted() -> None:
    metrics = Metrics()
    selection = Selection(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    data = request_bytes()
    first = ask(selection, data)
    second = ask(selection, data)
    assert first == second
    expected = select({"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "a100"})
    assert codec.select_response_to_json(first) == expected.to_json()
    assert selection.cache is not None
    assert (selection.cache.hits, selection.cache.misses) == (1, 1)
    assert selections(metrics) == {(str(expected.backend), expected.quantization): 2.0}


def test_a_worker_change_invalidates_kept_answers() -> None:
    platforms = Platforms(PLATFORM_PRESETS["a100"])
    selection = Selection(platforms, Metrics())
    data = request_bytes()
    assert ask(selection, data).server_platform.name == "a100"
    platforms.set(PLATFORM_PRESETS["h100"])
    answer = ask(selection, data)
    assert answer.server_platform.name == "h100"
    assert answer.platform.name == "h100"
    platforms.set(None)
    with pytest.raises(WorkerUnavailableError):
        ask(selection, data)
    # A request that names its platform needs no worker.
    assert ask(selection, request_bytes(platform="a100")).platform.name == "a100"


def test_errors_are_not_kept() -> None:
    metrics = Metrics()
    selection = Selection(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    bad = request_bytes(moe_backend="flashinfer_trtllm")  # forced, and incompatible
    for _ in range(2):
        with pytest.raises(SelectionError):
            ask(selection, bad)
    assert selection.cache is not None and len(selection.cache) == 0
    with pytest.raises(InvalidSpecError) as caught:
        ask(selection, b"\xff\xff not protobuf")
    assert "SelectBackendRequest" in str(caught.value)


def test_the_cache_can_be_turned_off() -> None:
    selection = Selection(Platforms(PLATFORM_PRESETS["a100"]), Metrics(), cache_bytes=0)
    data = request_bytes()
    assert ask(selection, data) == ask(selection, data)
    assert selection.cache is None


def test_the_cache_keeps_its_byte_budget_least_recently_used_first() -> None:
    cache = AnswerCache(max_bytes=100)

    def entry(size: int) -> CachedAnswer:
        return CachedAnswer(0, b"p" * size, ())

    cache.put(b"a" * 10, entry(30))
    cache.put(b"b" * 10, entry(30))
    assert cache.get(b"a" * 10, 0) is not None  # a is now the most recent
    cache.put(b"c" * 10, entry(30))  # 120 bytes: b goes
    assert cache.size == 80
    assert cache.get(b"b" * 10, 0) is None
    assert cache.get(b"a" * 10, 0) is not None
    assert cache.get(b"a" * 10, 1) is None  # another generation
    cache.put(b"d" * 10, entry(200))  # larger than the whole budget: not kept
    cache.put(b"e" * (MAX_KEY_BYTES + 1), entry(1))
    assert len(cache) == 2
    cache.put(b"a" * 10, entry(10))  # replaces, the size follows
    assert cache.size == 60
