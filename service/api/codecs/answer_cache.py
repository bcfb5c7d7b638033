"""Whole SelectBackend answers kept as response bytes, by request bytes.

A decision is a pure function of the request and of the workers' platform profiles, so an
answer can be served again, as the bytes it was, for the same request bytes while no worker
has changed (the data plane's `generation`). A kept answer is then one dict lookup: no
protobuf parsing, no oracle, no serialisation. That is why SelectBackend is registered on
bytes (the servicer), and why this cache is the codec's: it stores the encoded form.

The event loop and the offload threads (service.dataplane.offload: a matrix's cells, a
what-would-change answer) read and fill it at once, so each look-up and each store holds a
lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: Requests larger than this (a whole config.json is a few KiB) are answered, not kept.
MAX_KEY_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    generation: int
    payload: bytes
    #: Metric children one answer increments (selection and rejections).
    counters: tuple[Any, ...]


class AnswerCache:
    """Least-recently-used answers by request bytes, within a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, CachedAnswer] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, generation: int) -> CachedAnswer | None:
        """The answer kept for `key` under this generation (an older one is a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.generation != generation:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: bytes, answer: CachedAnswer) -> None:
        cost = len(key) + len(answer.payload)
        if len(key) > MAX_KEY_BYTES or cost > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.size -= len(key) + len(old.payload)
            self._entries[key] = answer
            self.size += cost
            while self.size > self.max_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                self.size -= len(evicted_key) + len(evicted.payload)
