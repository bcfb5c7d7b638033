"""The servicers in process: SelectBackend on bytes (the answer cache, its invalidation and
its metrics), and the one registration of every method."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.servicer import MoeControlServicer, SelectionServicer
from service.metrics import Metrics
from service.oracle import (
    PLATFORM_PRESETS,
    InvalidSpecError,
    PlatformProfile,
    SelectionError,
    select,
)
from service.pool.errors import WorkerNotFoundError, WorkerUnavailableError

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


def ask(selection: SelectionServicer, data: bytes) -> pb.SelectBackendResponse:
    payload = asyncio.run(selection.SelectBackend(data, None))
    return pb.SelectBackendResponse.FromString(payload)


def selections(metrics: Metrics) -> dict[tuple[str, ...], float]:
    """The selection series counted above zero (every other one is there at zero)."""
    out: dict[tuple[str, ...], float] = {}
    for family in metrics.registry.collect():
        if family.name == "moe_control_backend_selections":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    labels = sample.labels
                    key = (labels["backend"], labels["integration"], labels["platform"])
                    out[key] = sample.value
    return out


def test_repeated_requests_are_answered_from_the_cache_and_still_counted() -> None:
    metrics = Metrics()
    selection = SelectionServicer(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    data = request_bytes()
    first = ask(selection, data)
    second = ask(selection, data)
    assert first == second
    expected = select({"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "a100"})
    assert codec.select_response_to_json(first) == expected.to_json()
    assert selection.cache is not None
    assert (selection.cache.hits, selection.cache.misses) == (1, 1)
    assert selections(metrics) == {(str(expected.backend), expected.quantization, "worker"): 2.0}


def test_a_worker_change_invalidates_kept_answers() -> None:
    platforms = Platforms(PLATFORM_PRESETS["a100"])
    selection = SelectionServicer(platforms, Metrics())
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
    selection = SelectionServicer(Platforms(PLATFORM_PRESETS["a100"]), metrics)
    bad = request_bytes(moe_backend="flashinfer_trtllm")  # forced, and incompatible
    for _ in range(2):
        with pytest.raises(SelectionError):
            ask(selection, bad)
    assert selection.cache is not None and len(selection.cache) == 0
    with pytest.raises(InvalidSpecError) as caught:
        ask(selection, b"\xff\xff not protobuf")
    assert "SelectBackendRequest" in str(caught.value)


def test_the_cache_can_be_turned_off() -> None:
    selection = SelectionServicer(Platforms(PLATFORM_PRESETS["a100"]), Metrics(), cache_bytes=0)
    data = request_bytes()
    assert ask(selection, data) == ask(selection, data)
    assert selection.cache is None


class Pool:
    """What MoeControlServicer reads of a pool when it is built."""

    generation = 0
    layer_budget_bytes = 0

    def default_profile(self) -> PlatformProfile | None:
        return None


def test_every_method_is_registered_once() -> None:
    servicer = MoeControlServicer(Pool(), Metrics())  # type: ignore[arg-type]
    contract = [m.name for m in pb.DESCRIPTOR.services_by_name["MoeControlService"].methods]
    names = [*servicer.selection.handlers(), *servicer.worker_handlers()]
    assert tuple(servicer.selection.handlers()) == SelectionServicer.METHODS
    assert sorted(names) == sorted(contract)  # no method twice, none missing
    assert list(servicer.handlers()) == names
    handlers = servicer.handlers()
    # The byte-level paths: SelectBackend on bytes both ways, RunMoE's reply encoded.
    assert handlers["SelectBackend"].request_deserializer is None
    assert handlers["SelectBackend"].response_serializer is None
    assert handlers["RunMoE"].response_serializer(b"reply") == b"reply"
