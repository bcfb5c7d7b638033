"""One CUDA stream per request class, so a long conversion does not hold up a RunMoE.

Background jobs run in their own threads, but every thread issues its kernels to the
device's default stream unless told otherwise, and work on one stream runs in order: a
whole-checkpoint conversion would queue ahead of a microsecond-scale forward. Each request class
(RunMoE, conversion, measurement) gets its own stream instead; the job's thread makes it
current for the job's whole run (torch's current stream is per thread), so everything the
job launches, the Marlin workspace it picks (keyed by stream) and the CUDA events that time
it belong to that stream.

When a job ends its stream is synchronised before the answer goes out: what the job made
(a kept layer's tensors, an output copied for the server) is complete before anyone else can
use it from another stream, and tensors freed afterwards go back to the caching allocator
with no work pending on them. On a CPU worker (or any non-CUDA device) a scope does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from service.ipc.messages import ConvertCheckpoint, ConvertLayer, MeasureBackends, RunMoE

RUN = "run"
CONVERT = "convert"
MEASURE = "measure"

#: Background method -> request class; a method not listed runs on the RUN stream.
METHOD_CLASSES: dict[str, str] = {
    RunMoE.METHOD: RUN,
    ConvertLayer.METHOD: CONVERT,
    ConvertCheckpoint.METHOD: CONVERT,
    MeasureBackends.METHOD: MEASURE,
}


def request_class(method: str) -> str:
    return METHOD_CLASSES.get(method, RUN)


class Streams:
    """The worker's streams, made on first use, one per request class."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.device.type == "cuda"

    def stream(self, kind: str) -> torch.cuda.Stream | None:
        """The stream of request class `kind` (None off CUDA)."""
        if not self.enabled:
            return None
        with self._lock:
            found = self._streams.get(kind)
            if found is None:
                found = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
                self._streams[kind] = found
        return found

    @contextlib.contextmanager
    def scope(self, kind: str, *, synchronize: bool = True) -> Iterator[torch.cuda.Stream | None]:
        """Make `kind`'s stream (and its device) current in this thread for the block."""
        stream = self.stream(kind)
        if stream is None:
            yield None
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            try:
                yield stream
            finally:
                if synchronize:
                    stream.synchronize()

    def describe(self) -> Mapping[str, Any]:
        """The streams made so far, by class (for logs and tests)."""
        with self._lock:
            return {kind: int(s.stream_id) for kind, s in self._streams.items()}
