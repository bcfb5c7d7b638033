"""Progress of a whole-checkpoint run: its events, and the totals its answer reports.

Layers are written on their own threads while the next one converts, so both the events
and the totals are kept under locks: a consumer sees the counts only ever grow, and the
answer's totals add up whichever thread finished last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckFn", "Progress", "ProgressFn", "RunTotals"]

ProgressFn = Callable[[dict[str, Any]], None]
"""Receives each progress event (a JSON object)."""

CheckFn = Callable[[], None]
"""Raises when the run must stop (the caller cancelled); called between units and writes."""


class Progress:
    """Progress events, at most every `interval` seconds unless forced.

    A count and the event that reports it are one step under one lock (`__call__` with
    `layers`/`nbytes`), and events leave in the order their counts were taken: two layers
    written at once by two threads report 1/2 then 2/2, never 2/2 twice, and a consumer
    sees the counts only ever grow."""

    def __init__(self, emit: ProgressFn | None, layers_total: int, bytes_total: int) -> None:
        self.emit = emit
        self.layers_total = layers_total
        self.bytes_total = bytes_total
        self.layers_done = 0
        self.bytes_done = 0
        self._last = 0.0
        self._lock = threading.Lock()

    def add(self, *, layers: int = 0, nbytes: int = 0) -> None:
        """Count without reporting (the next event carries it)."""
        with self._lock:
            self.layers_done += layers
            self.bytes_done += nbytes

    def __call__(
        self,
        stage: str,
        current: str = "",
        *,
        force: bool = False,
        extra: Mapping[str, Any] | None = None,
        layers: int = 0,
        nbytes: int = 0,
    ) -> None:
        """Count `layers` and `nbytes` done, then emit an event (unless throttled) with the
        counts as this call left them. The emit runs under the lock: the callbacks only
        print or queue, and holding it is what keeps the events in count order."""
        with self._lock:
            self.layers_done += layers
            self.bytes_done += nbytes
            if self.emit is None:
                return
            now = time.monotonic()
            if not force and now - self._last < 0.1:
                return
            self._last = now
            self.emit(
                {
                    "stage": stage,
                    "layers_done": self.layers_done,
                    "layers_total": self.layers_total,
                    "bytes_done": min(self.bytes_done, self.bytes_total),
                    "bytes_total": self.bytes_total,
                    "current": current,
                    **(extra or {}),
                }
            )


@dataclass
class RunTotals:
    """What one run did, added up from every thread (under `lock`)."""

    converted: int = 0
    skipped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    #: Time spent in the conversion math (reader + writer), summed over layers.
    convert_seconds: float = 0.0
    #: Seconds per stage over the run's units (see `layers.LayerConversion.convert`).
    stage_seconds: dict[str, float] = field(default_factory=dict)
    #: The target layout's descriptor, from the first layer converted or skipped.
    descriptor: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_stages(self, stages: Mapping[str, float]) -> None:
        """(Under the lock.)"""
        for name, seconds in stages.items():
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + seconds
