"""The errors the server side of the worker boundary raises.

A worker that is not ready, an index or a layer no worker has, a worker's own error answer
rebuilt here, and the RunMoE refusals decided before or after a worker runs: each a domain
error with the facts a caller needs, no grpc in them (the API's error table maps them to
status codes).
"""

from __future__ import annotations

from typing import Any

from service.errors import MoeControlError


class WorkerError(MoeControlError):
    """Base class of the worker boundary's server-side errors."""


class WorkerUnavailableError(WorkerError):
    """No worker is ready to serve the request, or the one serving it died meanwhile."""


class WorkerNotFoundError(WorkerError):
    """A request named a worker index the server does not have."""

    def __init__(self, index: int, count: int) -> None:
        self.index = index
        self.count = count
        super().__init__(f"no worker {index}: this server has {count} (0..{count - 1})")


class LayerNotFoundError(WorkerError):
    """No worker holds a converted layer with this id."""

    def __init__(self, layer_id: str) -> None:
        self.layer_id = layer_id
        super().__init__(f"no worker holds layer {layer_id!r}")


class LayerLostError(LayerNotFoundError):
    """A kept layer whose worker restarted since it was loaded: gone with that process."""

    def __init__(self, layer_id: str, worker: int, device: str, reason: str) -> None:
        self.layer_id = layer_id
        self.worker_index = worker
        self.device = device
        self.reason = reason
        Exception.__init__(
            self,
            f"layer {layer_id!r} was held by worker {worker} ({device}), which restarted "
            f"({reason or 'reason unknown'}) and lost its layers; convert it again with "
            "keep_loaded (the other workers' layers are unaffected)",
        )


class WorkerCallError(WorkerError):
    """The worker answered a call with an error of its own; `details` (possibly empty) is
    what the worker said about it beyond the message (see service.ipc.protocol.error)."""

    def __init__(self, kind: str, message: str, details: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.message = message
        self.details: dict[str, Any] = dict(details or {})
        super().__init__(f"{kind}: {message}")


class BackendUnavailableError(WorkerError):
    """The backend a RunMoE needs cannot run on this worker (no GPU, no kernel library);
    RunMoE reports it instead of running another backend."""

    def __init__(self, backend: str, description: str) -> None:
        self.backend = backend
        self.description = description
        super().__init__(f"{backend} cannot run on this worker: {description}")


class WorkerDiedError(WorkerError):
    """A worker incarnation ended (no hello, a bad line, no answer to a ping); the message
    says how. The worker handle catches it and restarts the worker: it never reaches a
    caller, whose calls fail with WorkerUnavailableError instead."""
