"""One CUDA stream per request class (service/worker/streams.py): a long conversion does
not hold up a RunMoE, a job's kernels and timing events run on its class's stream, and a
scope leaves nothing pending when it ends."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from service.worker import main, streams
from service.worker.jobs import JobContext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LONG_CYCLES = 4_000_000_000
"""torch.cuda._sleep cycles: about two seconds at the H200's clock."""


def test_classes_get_distinct_non_default_streams() -> None:
    made = streams.Streams("cuda:0")
    run, convert, measure = (
        made.stream(k) for k in (streams.RUN, streams.CONVERT, streams.MEASURE)
    )
    assert run is not None and convert is not None and measure is not None
    ids = {run.stream_id, convert.stream_id, measure.stream_id}
    assert len(ids) == 3
    assert torch.cuda.default_stream().stream_id not in ids
    assert made.stream(streams.RUN) is run  # made once


def test_a_long_conversion_does_not_serialize_a_run() -> None:
    made = streams.Streams("cuda:0")
    x = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    with made.scope(streams.CONVERT, synchronize=False) as convert:
        assert convert is not None and torch.cuda.current_stream() == convert
        torch.cuda._sleep(LONG_CYCLES)
        convert_done = torch.cuda.Event()
        convert_done.record()
    began = time.perf_counter()
    with made.scope(streams.RUN):
        y = x * 2 + 1  # elementwise: no library handle to create on first use
        run_done = torch.cuda.Event()
        run_done.record()
    elapsed = time.perf_counter() - began  # the scope synchronised the RUN stream
    assert run_done.query() and not convert_done.query(), "the run waited for the conversion"
    assert elapsed < 0.5
    assert torch.equal(y, x * 2 + 1)
    convert_done.synchronize()


def test_scope_synchronises_its_stream_at_the_end() -> None:
    made = streams.Streams("cuda:0")
    with made.scope(streams.CONVERT):
        torch.cuda._sleep(LONG_CYCLES // 20)
        done = torch.cuda.Event()
        done.record()
    assert done.query()


def test_worker_jobs_run_on_their_class_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each background method's job runs with its class's stream current in its thread."""
    worker = main.Worker("cuda:0")
    seen: dict[str, int] = {}
    threads = []
    for method in main.BACKGROUND:
        monkeypatch.setitem(main.BACKGROUND, method, f"{__name__}:_report_stream")
        handler = worker.background(method)
        context = JobContext(1, lambda line: None)
        thread = threading.Thread(target=handler, args=({"method": method, "seen": seen}, context))
        threads.append(thread)
        thread.start()
    for thread in threads:
        thread.join()
    made = worker.streams.describe()
    assert set(seen) == set(main.BACKGROUND)
    for method, stream_id in seen.items():
        assert stream_id == made[streams.request_class(method)], method
    assert seen["run_moe"] != seen["convert_layer"]
    assert torch.cuda.default_stream().stream_id not in seen.values()


def _report_stream(
    worker: main.Worker, params: dict[str, Any], context: JobContext
) -> dict[str, Any]:
    params["seen"][params["method"]] = torch.cuda.current_stream().stream_id
    return {}
