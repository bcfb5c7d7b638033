"""What a job of the worker sees of the worker that runs it.

The job modules (run, convert, measure) take a `WorkerContext` rather than `main.Worker`:
they need its device, its kept layers and its device transport, not the request loop, and
`main` imports them to run them, so naming `Worker` there would close a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from service.worker.jobs import JobContext
from service.worker.layers import LayerStore

if TYPE_CHECKING:
    from service.worker.transport import Transport


class WorkerContext(Protocol):
    """The worker a job runs in (`main.Worker` is one)."""

    @property
    def device(self) -> str:
        """The device this worker owns: 'cpu', 'cuda:N' or 'xpu:N'."""
        ...

    @property
    def layers(self) -> LayerStore:
        """The layers this worker keeps between calls."""
        ...

    @property
    def transport(self) -> Transport:
        """Segment <-> device copies through pinned staging (made on first use)."""
        ...


#: A background job of the worker (`main.BACKGROUND` names them): the worker, the call's
#: request (a `service.ipc.messages` request) and its job context in, its answer out.
Job = Callable[[WorkerContext, Any, JobContext], object]
