"""The worker's measure_backends job in process (CPU): what it times, what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.ipc import codec
from service.ipc.messages import MeasureBackends
from service.kernels.errors import KernelInputError
from service.worker.jobs import JobContext
from service.worker.main import BACKGROUND, Worker
from service.worker.measure import measure_backends, median_seconds

SHAPE = {"num_experts": 4, "top_k": 2, "hidden_size": 64, "intermediate_size": 64}
SOURCE = {"layout": "gptq", "bits": 4, "group_size": 32, "symmetric": True}


def params(**extra: Any) -> MeasureBackends:
    """The request as the server sends it (its JSON decoded as the worker decodes it)."""
    values = {
        "shape": SHAPE,
        "source": SOURCE,
        "backends": ["EMULATION", "MARLIN", "CPU"],
        "token_counts": [1, 3],
        "budget_s": 0.01,
        **extra,
    }
    return codec.from_json(MeasureBackends, values)


@pytest.fixture(scope="module")
def worker() -> Worker:
    return Worker("cpu")


def test_times_what_runs_and_says_why_the_rest_cannot(worker: Worker) -> None:
    answer = measure_backends(worker, params(), JobContext(1, lambda line: None))
    assert answer.device_name == "cpu" and answer.versions["torch"]
    by = {r.backend: r for r in answer.results}
    assert list(by) == ["EMULATION", "MARLIN", "CPU"]
    assert set(by["EMULATION"].seconds) == {"1", "3"}
    assert all(s > 0 for s in by["EMULATION"].seconds.values())
    assert "CUDA" in by["MARLIN"].error and not by["MARLIN"].seconds
    assert "no kernel" in by["CPU"].error
    assert BACKGROUND[MeasureBackends] == "service.worker.measure:measure_backends"


def test_asymmetric_and_int8_layers_are_timed(worker: Worker) -> None:
    for source in ({**SOURCE, "symmetric": False}, {**SOURCE, "bits": 8}):
        answer = measure_backends(
            worker,
            params(source=source, backends=["EMULATION"], token_counts=[2]),
            JobContext(2, lambda line: None),
        )
        assert answer.results[0].seconds["2"] > 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"token_counts": []}, "token_counts"),
        ({"token_counts": [0]}, "token_counts"),
        ({"token_counts": [1] * 17}, "token_counts"),
        ({"shape": {**SHAPE, "hidden_size": 0}}, "shape.hidden_size"),
    ],
)
def test_bad_requests_name_the_field(worker: Worker, change: dict[str, Any], field: str) -> None:
    with pytest.raises(KernelInputError) as info:
        measure_backends(worker, params(**change), JobContext(3, lambda line: None))
    assert info.value.field == field


def test_median_takes_at_least_three_runs_after_a_warm_up() -> None:
    calls: list[int] = []
    seconds = median_seconds(lambda: calls.append(1), torch.device("cpu"), budget_s=0.0)
    assert len(calls) == 4 and seconds >= 0
