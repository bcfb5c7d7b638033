"""One stream per request class (streams.py): the method table, and that on a CPU worker a
scope changes nothing while every background job still runs through one. The CUDA behaviour
(a long conversion does not hold up a RunMoE) is tests/gpu/test_worker_streams.py."""

from __future__ import annotations

from typing import Any

import torch

from service.ipc.messages import CheckTarget, TargetChecked
from service.worker import main, streams
from service.worker.jobs import JobContext


def test_every_background_method_has_its_class() -> None:
    assert streams.request_class("run_moe") == streams.RUN
    assert streams.request_class("convert_layer") == streams.CONVERT
    assert streams.request_class("convert_checkpoint") == streams.CONVERT
    assert streams.request_class("measure_backends") == streams.MEASURE
    assert {kind.METHOD for kind in main.BACKGROUND} <= set(streams.METHOD_CLASSES)


def test_cpu_scope_is_a_no_op() -> None:
    cpu = streams.Streams("cpu")
    assert not cpu.enabled and cpu.stream(streams.RUN) is None
    with cpu.scope(streams.CONVERT) as stream:
        assert stream is None
        assert float(torch.ones(3).sum()) == 3.0
    assert cpu.describe() == {}


def test_jobs_run_inside_their_scope(monkeypatch: Any) -> None:
    """The worker's job wrapper enters the method's class scope around the job."""
    worker = main.Worker("cpu")
    entered: list[str] = []
    real_scope = worker.streams.scope

    def scope(kind: str, *, synchronize: bool = True) -> Any:
        entered.append(kind)
        return real_scope(kind, synchronize=synchronize)

    monkeypatch.setattr(worker.streams, "scope", scope)
    monkeypatch.setitem(main.BACKGROUND, CheckTarget, f"{__name__}:_job")
    monkeypatch.setitem(streams.METHOD_CLASSES, CheckTarget.METHOD, streams.CONVERT)
    handler = worker.background(CheckTarget)
    answer = handler(CheckTarget("TRITON"), JobContext(1, lambda line: None))
    assert answer == {"supported": True, "reason": "TRITON"}
    assert entered == [streams.CONVERT]


def _job(worker: main.Worker, request: CheckTarget, context: JobContext) -> TargetChecked:
    return TargetChecked(True, request.backend)
