"""SelectBackend: codec -> oracle -> codec, with a bounded cache of whole answers.

A decision is a pure function of the request and of the workers' platform profiles (the
default platform is worker 0's; a request may name another worker's), so an answer can be
kept as the response bytes and served again for the same request bytes while no worker has
changed (`PlatformSource.generation` moves on every worker change). The hot path of a
repeated request is then one dict lookup and the metric increments: no protobuf parsing,
no oracle, no serialisation. This is why SelectBackend is registered at the byte level
(`handlers()`): grpc would otherwise parse and serialise messages around the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from service.api import codec
from service.api.generated.moe_control.v1 import measured_pb2, platform_pb2
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.metrics import Metrics
from service.oracle import (
    DEFAULT_RULESET,
    PLATFORM_PRESETS,
    InvalidSpecError,
    PlatformProfile,
    SelectionError,
    parse_deployment,
    select,
)
from service.pool.errors import WorkerUnavailableError

if TYPE_CHECKING:
    from service.api.measured import MeasuredAnswerer

MIB = 1024 * 1024
#: Requests larger than this (a whole config.json is a few KiB) are answered, not kept.
MAX_KEY_BYTES = 64 * 1024


class PlatformSource(Protocol):
    """What SelectBackend needs from the workers (WorkerPool, or a replica's view of it)."""

    @property
    def generation(self) -> int:
        """Moves on whenever any worker's state or profile may have changed."""
        ...

    def profile(self, index: int) -> PlatformProfile:
        """A ready worker's profile (WorkerNotFoundError, WorkerUnavailableError)."""
        ...

    def default_profile(self) -> PlatformProfile | None:
        """Worker 0's profile while it is ready."""
        ...


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

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, generation: int) -> CachedAnswer | None:
        """The answer kept for `key` under this generation (an older one is a miss)."""
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
        old = self._entries.pop(key, None)
        if old is not None:
            self.size -= len(key) + len(old.payload)
        self._entries[key] = answer
        self.size += cost
        while self.size > self.max_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self.size -= len(evicted_key) + len(evicted.payload)


class Selection:
    """SelectBackend (and the preset list) for one server process."""

    def __init__(
        self, platforms: PlatformSource, metrics: Metrics, *, cache_bytes: int = 32 * MIB
    ) -> None:
        self._platforms = platforms
        self._metrics = metrics
        self.cache = AnswerCache(cache_bytes) if cache_bytes > 0 else None
        #: Policy MEASURED (service/api/measured.py): the primary's policy, a replica's
        #: forwarder, or None where it is not served. Its answers bypass `cache`.
        self.measured: MeasuredAnswerer | None = None
        self.presets = pb.ListPlatformPresetsResponse(
            presets=[
                platform_pb2.PlatformPreset(name=name, profile=codec.platform_to_pb(profile))
                for name, profile in sorted(PLATFORM_PRESETS.items())
            ]
        )

    def answer(self, request: pb.SelectBackendRequest) -> pb.SelectBackendResponse:
        """The response to a request, counted in the metrics; domain errors propagate."""
        response, _ = self._decide(request)
        return response

    @property
    def generation(self) -> int:
        """Moves on whenever a worker changes (answers kept under an older one are stale)."""
        return self._platforms.generation

    def decide(self, request: pb.SelectBackendRequest) -> tuple[pb.SelectBackendResponse, Any]:
        """`answer`, with the metric children it incremented (a caller that keeps the answer
        increments them again when it serves it again); domain errors propagate, counted."""
        return self._decide(request)

    def count_rejections(self, candidates: Any) -> None:
        """Count a failed decision's rejections again (a kept answer served again)."""
        self._metrics.count_rejections(candidates)

    async def answer_async(self, request: pb.SelectBackendRequest) -> pb.SelectBackendResponse:
        """`answer`, or the measured answer for policy MEASURED."""
        if request.policy == measured_pb2.SELECTION_POLICY_MEASURED:
            return await self._measured().answer(self, request)
        return self.answer(request)

    def _measured(self) -> MeasuredAnswerer:
        if self.measured is None:
            raise WorkerUnavailableError("policy MEASURED is not served by this process")
        return self.measured

    def _decide(self, request: pb.SelectBackendRequest) -> tuple[pb.SelectBackendResponse, Any]:
        spec = codec.deployment_to_json(request)
        platform = codec.platform_override(request.platform, self._platforms.profile)
        if platform is not None:
            spec["platform"] = platform
        default = self._platforms.default_profile()
        if spec.get("platform") is None and default is None:
            raise WorkerUnavailableError(
                "no worker is ready to supply the default platform; "
                "name a preset or a platform for a what-if answer"
            )
        deployment = parse_deployment(spec, default_platform=default)
        try:
            decision = select(deployment, ruleset=request.ruleset or DEFAULT_RULESET)
        except SelectionError as exc:
            self._metrics.count_rejections(exc.candidates)
            raise
        counters = self._metrics.decision_counters(decision)
        for counter in counters:
            counter.inc()
        return codec.select_response(decision, deployment.platform, default), counters

    async def select_backend_bytes(self, data: bytes, context: Any) -> bytes:
        """SelectBackend on the wire form: a kept answer when there is one, else decide and
        keep it. Only answers are kept; errors are decided again each time."""
        generation = self._platforms.generation
        cache = self.cache
        if cache is not None:
            kept = cache.get(data, generation)
            if kept is not None:
                for counter in kept.counters:
                    counter.inc()
                return kept.payload
        try:
            request = pb.SelectBackendRequest.FromString(data)
        except DecodeError:
            raise InvalidSpecError.single(
                "", "the request is not a moe_control.v1.SelectBackendRequest message"
            ) from None
        if request.policy == measured_pb2.SELECTION_POLICY_MEASURED:
            return await self._measured().answer_bytes(self, data, request, context)
        response, counters = self._decide(request)
        payload: bytes = response.SerializeToString()
        if cache is not None:
            cache.put(data, CachedAnswer(generation, payload, counters))
        return payload

    async def list_platform_presets(
        self, request: pb.ListPlatformPresetsRequest, context: Any
    ) -> pb.ListPlatformPresetsResponse:
        return self.presets

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        """The MoeControlService methods that need no worker, by name (SelectBackend on
        bytes): what the public server of every process serves itself (front.py)."""
        return {
            "SelectBackend": grpc.unary_unary_rpc_method_handler(self.select_backend_bytes),
            "ListPlatformPresets": grpc.unary_unary_rpc_method_handler(
                self.list_platform_presets,
                request_deserializer=pb.ListPlatformPresetsRequest.FromString,
                response_serializer=pb.ListPlatformPresetsResponse.SerializeToString,
            ),
        }
