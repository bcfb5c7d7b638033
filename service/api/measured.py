"""SelectBackend's policy MEASURED on the wire: kept answer bytes, or the primary's answer.

The measuring itself is the data plane's (service/dataplane/measured.py). What is here is
how a process answers a MEASURED request's bytes: the primary asks its policy and keeps
the bytes of answers served from the timing cache, so a repeat is served without a
decision or any parsing while no worker and no timing changed (`MeasuredAnswers`). A
replica has no workers: it passes the request's bytes to the primary over its private
socket (`service.server.forward.ForwardedMeasure`, beside the other forwarding).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.dataplane.measured import MeasuredPolicy
from service.dataplane.selection import Selector

#: Cache-served answers kept as bytes, by request bytes (least recently used dropped).
MAX_KEPT_ANSWERS = 1024


class MeasuredAnswerer(Protocol):
    """What SelectBackend calls for a MEASURED request (the primary's answers, or a
    replica's forwarder)."""

    async def answer_bytes(
        self, data: bytes, request: pb.SelectBackendRequest, context: Any
    ) -> bytes: ...


@dataclass(frozen=True)
class KeptAnswer:
    """A cache-served MEASURED answer's bytes, valid under one worker generation and one
    store revision, and how to count its static decision again."""

    generation: int
    revision: int
    payload: bytes
    recount: Callable[[], None]


class MeasuredAnswers:
    """The primary's MEASURED answers as bytes, the cache-served ones kept."""

    def __init__(self, policy: MeasuredPolicy, selector: Selector) -> None:
        self.policy = policy
        self._selector = selector
        self._answers: OrderedDict[bytes, KeptAnswer] = OrderedDict()

    async def answer_bytes(
        self, data: bytes, request: pb.SelectBackendRequest, context: Any
    ) -> bytes:
        """The answer's bytes; a repeat of a request answered from the timing cache is
        served as kept bytes while no worker and no timing has changed, and counted in the
        metrics exactly like a fresh answer."""
        generation, revision = self._selector.generation, self.policy.store.revision
        kept = self._answers.get(data)
        fresh = kept is not None and (kept.generation, kept.revision) == (generation, revision)
        if kept is not None and fresh and not request.refresh:
            self._answers.move_to_end(data)
            kept.recount()
            return kept.payload
        answer, recount = await self.policy.answer(self._selector, codec.select_query(request))
        payload: bytes = codec.select_answer(answer).SerializeToString()
        measured = answer.measured
        if measured is not None and measured.from_cache and self.policy.store.revision == revision:
            self._answers[data] = KeptAnswer(generation, revision, payload, recount)
            while len(self._answers) > MAX_KEPT_ANSWERS:
                self._answers.popitem(last=False)
        return payload
