"""An HTTP app over an in-process data plane: the real SelectionServicer's selector and
listings, a fake pool (one CPU worker, one kept layer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from service.api.codecs.answer_cache import AnswerCache
from service.api.interceptors.limits import Limits
from service.api.servicer import SelectionServicer
from service.http.app import build_app
from service.http.handlers import Plane
from service.http.state import LocalState
from service.metrics import Metrics
from service.oracle import PLATFORM_PRESETS, PlatformProfile
from service.pool.errors import WorkerNotFoundError
from service.pool.handle import WorkerSnapshot, WorkerState
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CONFIG = json.loads((ROOT / "docs" / "examples" / "qwen2-moe-gptq-config.json").read_text())
LAYER = {"num_experts": 64, "top_k": 6, "hidden_size": 2048, "intermediate_size": 1408}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
SPEC = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h200"}
TOKEN = "s3cret-token"


class FakePool:
    """A PlatformSource and the pool calls the listings make: worker 0, a CPU."""

    generation = 0
    ready = True

    def __init__(self) -> None:
        self._profile = PLATFORM_PRESETS["a100"]

    def profile(self, index: int) -> PlatformProfile:
        if index != 0:
            raise WorkerNotFoundError(index, 1)
        return self._profile

    def default_profile(self) -> PlatformProfile | None:
        return self._profile

    async def describe(self) -> list[WorkerSnapshot]:
        return [
            WorkerSnapshot(
                0, "cpu", WorkerState.READY, 1234, 0, self._profile, "cpu", 0, "2.11", 1.0, ""
            )
        ]

    async def list_layers(self, index: int | None = None) -> list[dict[str, Any]]:
        if index not in (None, 0):
            raise WorkerNotFoundError(index, 1)
        return [{"layer_id": "l1", "worker_index": 0, "num_experts": 8, "byte_size": 2**40}]


def make_client(
    settings: Settings | None = None,
    ready: bool = True,
    metrics: Metrics | None = None,
    limits: Limits | None = None,
    cache: AnswerCache | None = None,
) -> tuple[TestClient, Metrics]:
    metrics = metrics or Metrics()
    pool = FakePool()
    selection = SelectionServicer(pool, metrics)
    plane = Plane(
        selection.selector,
        selection.presets,
        selection.rulesets,
        LocalState(pool, None),  # type: ignore[arg-type]
        lambda: ready,
        cache=cache,
    )
    app = build_app(plane, settings or Settings(), metrics, limits)
    return TestClient(app), metrics


@pytest.fixture
def client() -> Iterator[TestClient]:
    test_client, _ = make_client()
    with test_client:
        yield test_client
