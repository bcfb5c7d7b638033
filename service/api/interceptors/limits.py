"""Per-method concurrency limits: one asyncio semaphore per method class.

grpc's own `maximum_concurrent_rpcs` (`--max-concurrent-rpcs`) counts every call alike, so a
burst of cheap SelectBackend calls used to take every slot and refuse conversions and forwards
too (bench/soak.py found it). Each expensive or bursty method class therefore gets its own
limit (`--max-concurrent-select`, `--max-concurrent-convert`, `--max-concurrent-run`; 0: no
limit), checked by `ConcurrencyLimits` (innermost of the interceptors: after auth, before
the handler). A call over its limit waits at most `--concurrency-wait-s` (default 0:
refused at once, never queued) and is then refused with RESOURCE_EXHAUSTED
(`ConcurrencyLimitError`, mapped in `service.api.errors`). Health and reflection
are in no class, so they are never limited. A streaming call holds its slot until the
stream ends, however it ends (completion, error, cancellation, deadline): the release runs
once, from the handler's `finally` or from the call's done callback, whichever is first.

The limits are per server process; the primary's private endpoint for replicas' forwarded
calls shares the primary's `Limits`, so conversions and forwards are bounded server-wide.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from service.api.errors import ConcurrencyLimitError
from service.api.interceptors.handlers import Context, Method, Stream, Unary
from service.api.names import SERVICE_NAME
from service.metrics import Metrics
from service.settings import Settings

SERVICE = SERVICE_NAME

#: Full method name -> the Settings field that limits it (its method class). Methods not
#: here (health, reflection, the cheap listings) are limited by nothing but the global limit.
METHOD_LIMITS: Mapping[str, str] = {
    f"/{SERVICE}/SelectBackend": "max_concurrent_select",
    # a diff is a few decisions: the same class as a selection
    f"/{SERVICE}/DiffRulesets": "max_concurrent_select",
    # a matrix is many decisions, as POST /v1/select:matrix (the same class)
    f"/{SERVICE}/SelectMatrix": "max_concurrent_select",
    f"/{SERVICE}/ConvertWeights": "max_concurrent_convert",
    f"/{SERVICE}/RunMoE": "max_concurrent_run",
}


class Limit:
    """The slots of one method class."""

    def __init__(self, name: str, value: int, wait_s: float, refused: Any) -> None:
        self.name = name
        self.value = value
        self._wait_s = wait_s
        self.semaphore = asyncio.Semaphore(value)
        self._refused = refused

    @property
    def available(self) -> int:
        """Free slots now (tests use it to prove that nothing leaked)."""
        return self.semaphore._value  # asyncio keeps no public counter

    async def acquire(self, method: str) -> None:
        """Take a slot, waiting at most the configured wait; raises ConcurrencyLimitError.

        A free slot is taken without suspending (asyncio.Semaphore.acquire returns at once
        when it is not locked), so the hot path costs no event-loop round trip; the unary
        wrapper does that part inline and calls `wait_or_refuse` only when locked."""
        semaphore = self.semaphore
        if not semaphore.locked():
            await semaphore.acquire()
            return
        await self.wait_or_refuse(method)

    async def wait_or_refuse(self, method: str) -> None:
        """The slow path: every slot taken. Wait at most the configured wait, else refuse."""
        semaphore = self.semaphore
        if self._wait_s > 0:
            try:
                await asyncio.wait_for(semaphore.acquire(), self._wait_s)
                return
            except TimeoutError:
                pass
        self._refused(method).inc()
        raise ConcurrencyLimitError(method, self.name, self.value)

    def release(self) -> None:
        self.semaphore.release()


@dataclass(frozen=True, slots=True)
class Limits:
    """Every method class's Limit, by full method name."""

    by_method: Mapping[str, Limit]

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics | None) -> Limits:
        by_method: dict[str, Limit] = {}
        made: dict[str, Limit] = {}
        for method, name in METHOD_LIMITS.items():
            value = getattr(settings, name)
            if not value:
                continue
            limit = made.get(name)
            if limit is None:
                limit = made[name] = Limit(
                    name, value, settings.concurrency_wait_s, _refusals(metrics, name)
                )
            by_method[method] = limit
            # The series exists at 0 from the start, so dashboards and rate() see a limit
            # that has never refused anything (a labelled counter has no series until used).
            _refusals(metrics, name)(method)
        return cls(by_method)

    def for_method(self, method: str) -> Limit | None:
        return self.by_method.get(method)


class _Uncounted:
    def inc(self, amount: float = 1) -> None:
        pass


def _refusals(metrics: Metrics | None, name: str) -> Any:
    """method -> the counter child a refusal of it increments."""
    if metrics is None:
        return lambda method: _Uncounted()
    counter = metrics.rpc_limited

    def child(method: str) -> Any:
        return counter.labels(method.rsplit("/", 1)[-1], name)

    return child


class SlotHolder:
    """Releases a streaming call's slot exactly once: from the handler's `finally` or from
    the call's done callback (a cancelled stream whose generator is not closed yet)."""

    __slots__ = ("_limit",)

    def __init__(self, limit: Limit) -> None:
        self._limit: Limit | None = limit

    def release(self, _context: Any = None) -> None:
        limit, self._limit = self._limit, None
        if limit is not None:
            limit.release()


class ConcurrencyLimits:
    """Holds a slot of its method class for each call of a limited method; the other
    methods are left as they are."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def unary(self, method: Method, inner: Unary) -> Unary:
        limit = self._limits.for_method(method.full_name)
        if limit is None:
            return inner
        semaphore, name = limit.semaphore, method.full_name

        async def limited(request: Any, context: Context) -> Any:
            if semaphore.locked():
                await limit.wait_or_refuse(name)
            else:
                await semaphore.acquire()  # free: returns without suspending
            try:
                return await inner(request, context)
            finally:
                semaphore.release()

        return limited

    def stream(self, method: Method, inner: Stream) -> Stream:
        limit = self._limits.for_method(method.full_name)
        if limit is None:
            return inner
        name = method.full_name

        async def limited(request: Any, context: Context) -> AsyncIterator[Any]:
            await limit.acquire(name)
            # The slot is held until the stream ends, however it ends: the finally below,
            # or the call's end where the generator is not closed yet.
            holder = SlotHolder(limit)
            context.add_done_callback(holder.release)  # type: ignore[arg-type]  # stubs: a class, not a callable
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                holder.release()

        return limited
