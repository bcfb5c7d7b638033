"""The MoeControlService servicers: each method is codec -> data plane -> codec.

Every method is registered once, from one table per servicer (`handlers()`):

* `SelectionServicer` answers the methods every server process serves itself, with or
  without workers (SelectBackend, ListPlatformPresets, ListRulesets, DiffRulesets: a
  replica answers them as the primary would, from the same oracle). SelectBackend is registered on
  bytes: a repeated request is answered from the cache of whole answers
  (codecs/answer_cache.py) without parsing it; only a miss parses, decides and encodes.
* `MoeControlServicer` is the primary's: the selection methods (its own
  SelectionServicer, with the measured policy) and the methods that need the workers.
  RunMoE is registered with a bytes response serializer: its reply is encoded straight
  from the output's segment (codecs/run.py).

Errors are domain exceptions; the interceptor turns them into statuses (errors.py).
"""

# ruff: noqa: N802 - method names are the contract's RPC names

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from service.api.codecs import conversion, workers
from service.api.codecs import matrix as matrix_codec
from service.api.codecs import observed as observed_codec
from service.api.codecs import rulesets as rulesets_codec
from service.api.codecs import run as run_codec
from service.api.codecs import selection as codec
from service.api.codecs import upgrade as upgrade_codec
from service.api.codecs.answer_cache import AnswerCache, CachedAnswer
from service.api.generated.moe_control.v1 import measured_pb2, observed_pb2
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.matrix import decide_matrix
from service.api.measured import MeasuredAnswerer, MeasuredAnswers
from service.api.names import SERVICE_NAME
from service.dataplane.convert import Converter
from service.dataplane.measured import MeasuredPolicy
from service.dataplane.observed import Observations
from service.dataplane.offload import Budget, Offload
from service.dataplane.run import Runner
from service.dataplane.selection import PlatformSource, Selector
from service.dataplane.upgrade import diff
from service.metrics import Metrics
from service.pool.errors import WorkerUnavailableError
from service.pool.pool import WorkerPool
from service.settings import MIB, Settings

Context = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only
_MEASURED = measured_pb2.SELECTION_POLICY_MEASURED
#: A SelectBackend request larger than this (a whole config.json is a few KiB) is decided
#: off the event loop: parsing it may take a while.
LARGE_REQUEST_BYTES = 64 * 1024


def _unary(method: Any, request: Any, response: Any) -> Handler:
    return grpc.unary_unary_rpc_method_handler(
        method, request_deserializer=request.FromString, response_serializer=response
    )


def _time_left(context: Any) -> float | None:
    """The call's remaining time (None: no deadline, or no call, as in a direct use)."""
    return None if context is None else context.time_remaining()


def _as_bytes(reply: bytes) -> bytes:
    """The serializer of a method that encodes its replies itself."""
    return reply


class SelectionServicer:
    """SelectBackend, the preset list, the ruleset list and the diff between rulesets for
    one server process."""

    #: The methods it serves (what every process answers itself).
    METHODS = (
        "SelectBackend",
        "ListPlatformPresets",
        "ListRulesets",
        "DiffRulesets",
        "SelectMatrix",
    )

    def __init__(
        self,
        platforms: PlatformSource,
        metrics: Metrics,
        *,
        cache_bytes: int = 32 * MIB,
        offload: Offload | None = None,
    ) -> None:
        self._platforms = platforms
        self.selector = Selector(platforms, metrics)
        self.cache = AnswerCache(cache_bytes) if cache_bytes > 0 else None
        #: Where CPU-heavy calls run, off the event loop (the HTTP door shares it).
        self.offload = offload if offload is not None else Offload()
        #: Policy MEASURED: the primary's answers, a replica's forwarder, or None where it
        #: is not served. Its answers bypass `cache`.
        self.measured: MeasuredAnswerer | None = None
        self.presets = codec.presets_response()
        self.rulesets = rulesets_codec.rulesets_response()

    async def SelectBackend(self, data: bytes, context: Any) -> bytes:
        """On the wire form: a kept answer when there is one, else decide and keep it.
        Only answers are kept; errors are decided again each time. A decision with the
        what-would-change search (tens of milliseconds), or from a large request, is made
        off the event loop; a plain one (a fraction of a millisecond) on it."""
        generation = self._platforms.generation
        cache = self.cache
        if cache is not None:
            kept = cache.get(data, generation)
            if kept is not None:
                for counter in kept.counters:
                    counter.inc()
                return kept.payload
        request = codec.select_request(data)
        if request.policy == _MEASURED:
            if self.measured is None:
                raise WorkerUnavailableError("policy MEASURED is not served by this process")
            return await self.measured.answer_bytes(data, request, context)
        if request.what_would_change or len(data) > LARGE_REQUEST_BYTES:
            budget = self.offload.budget(_time_left(context))
            return await self.offload.run(
                lambda budget: self._decide(data, request, generation, budget), budget
            )
        return self._decide(data, request, generation, None)

    def _decide(self, data: bytes, request: Any, generation: int, budget: Budget | None) -> bytes:
        if budget is not None:
            budget.check("the decision")
        answer, counters = self.selector.decide(codec.select_query(request))
        payload: bytes = codec.select_answer(answer).SerializeToString()
        if self.cache is not None:
            self.cache.put(data, CachedAnswer(generation, payload, counters))
        return payload

    async def ListPlatformPresets(
        self, request: pb.ListPlatformPresetsRequest, context: Any
    ) -> pb.ListPlatformPresetsResponse:
        return self.presets

    async def ListRulesets(
        self, request: pb.ListRulesetsRequest, context: Any
    ) -> pb.ListRulesetsResponse:
        return self.rulesets

    async def DiffRulesets(
        self, request: pb.DiffRulesetsRequest, context: Any
    ) -> pb.DiffRulesetsResponse:
        """Off the event loop: every ruleset's decision, each with its search."""

        def decide(budget: Budget) -> pb.DiffRulesetsResponse:
            budget.check("the diff")
            query = upgrade_codec.diff_query(request)
            return upgrade_codec.diff_response(diff(self.selector, query), query.fail_on)

        return await self.offload.run(decide, self.offload.budget(_time_left(context)))

    async def SelectMatrix(self, request: pb.SelectMatrixRequest, context: Any) -> bytes:
        """Off the event loop, all of it: the specs parsed, every cell (service.api.matrix,
        as POST /v1/select:matrix decides them, kept in this process's answer cache), the
        answer encoded."""

        def decide(budget: Budget) -> bytes:
            query = matrix_codec.matrix_query(request)
            table = decide_matrix(self.selector, self.cache, query, budget)
            payload: bytes = matrix_codec.matrix_response(table).SerializeToString()
            return payload

        return await self.offload.run(decide, self.offload.budget(_time_left(context)))

    def handlers(self) -> dict[str, Handler]:
        """Its methods' handlers, by name (SelectBackend on bytes both ways)."""
        return {
            "SelectBackend": grpc.unary_unary_rpc_method_handler(self.SelectBackend),
            "ListPlatformPresets": _unary(
                self.ListPlatformPresets,
                pb.ListPlatformPresetsRequest,
                pb.ListPlatformPresetsResponse.SerializeToString,
            ),
            "ListRulesets": _unary(
                self.ListRulesets,
                pb.ListRulesetsRequest,
                pb.ListRulesetsResponse.SerializeToString,
            ),
            "DiffRulesets": _unary(
                self.DiffRulesets,
                pb.DiffRulesetsRequest,
                pb.DiffRulesetsResponse.SerializeToString,
            ),
            "SelectMatrix": _unary(self.SelectMatrix, pb.SelectMatrixRequest, _as_bytes),
        }


class MoeControlServicer:
    """The primary's servicer: every method, the worker ones through the data plane."""

    def __init__(
        self, workers: WorkerPool, metrics: Metrics, settings: Settings | None = None
    ) -> None:
        self._workers = workers
        settings = settings or Settings()
        workers.layer_budget_bytes = settings.layer_budget_mib * MIB
        self.selection = SelectionServicer(
            workers,
            metrics,
            cache_bytes=settings.select_cache_mib * MIB,
            offload=Offload.from_settings(settings),
        )
        policy = MeasuredPolicy(workers, settings.state_dir)
        self.selection.measured = MeasuredAnswers(policy, self.selection.selector)
        self.convert = Converter(workers, metrics, settings)
        self.run = Runner(workers, metrics, settings, self.convert.segments)
        self.observations = Observations(
            metrics,
            state_dir=settings.state_dir,
            max_deployments=settings.observed_max_deployments,
            compare_ruleset=settings.observed_ruleset,
        )

    async def ConvertWeights(
        self, request_iterator: AsyncIterator[pb.ConvertWeightsRequest], context: Context
    ) -> AsyncIterator[pb.ConvertWeightsResponse]:
        header, items = await conversion.convert_call(request_iterator)
        # Closed with this call: a cancelled call cleans up (segments, a kept layer) now.
        async with contextlib.aclosing(self.convert.convert(header, items)) as events:
            async for event in events:
                yield conversion.event_to_pb(event)

    async def RunMoE(self, request: pb.RunMoERequest, context: Context) -> bytes:
        return await self.run.run(run_codec.run_request(request), run_codec.reply_bytes)

    async def GetPlatform(
        self, request: pb.GetPlatformRequest, context: Context
    ) -> pb.GetPlatformResponse:
        index = request.worker_index if request.HasField("worker_index") else 0
        worker = self._workers.worker(index).snapshot()
        return pb.GetPlatformResponse(worker=workers.worker_to_pb(worker))

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: Context
    ) -> pb.ListWorkersResponse:
        return workers.workers_response(await self._workers.describe(), self._workers.ready)

    async def ListLayers(
        self, request: pb.ListLayersRequest, context: Context
    ) -> pb.ListLayersResponse:
        index = request.worker_index if request.HasField("worker_index") else None
        return workers.layers_response(await self._workers.list_layers(index))

    async def UnloadLayer(
        self, request: pb.UnloadLayerRequest, context: Context
    ) -> pb.UnloadLayerResponse:
        freed = await self._workers.unload_layer(request.layer_id)
        return pb.UnloadLayerResponse(freed_bytes=freed)

    async def ReportDecisions(
        self, request: observed_pb2.ReportDecisionsRequest, context: Context
    ) -> observed_pb2.ReportDecisionsResponse:
        process, decisions = observed_codec.report_request(request)
        accepted = self.observations.report(process, decisions)
        return observed_pb2.ReportDecisionsResponse(accepted=accepted)

    async def ListObservedDecisions(
        self, request: observed_pb2.ListObservedDecisionsRequest, context: Context
    ) -> observed_pb2.ListObservedDecisionsResponse:
        entries = self.observations.listing(mismatches_only=request.mismatches_only)
        return observed_codec.listing_response(entries, self.observations.evicted)

    def observed_handlers(self) -> dict[str, Handler]:
        """ReportDecisions and ListObservedDecisions: the primary's one store of observed
        decisions (a replica forwards them here, as it does the worker methods)."""
        return {
            "ReportDecisions": _unary(
                self.ReportDecisions,
                observed_pb2.ReportDecisionsRequest,
                observed_pb2.ReportDecisionsResponse.SerializeToString,
            ),
            "ListObservedDecisions": _unary(
                self.ListObservedDecisions,
                observed_pb2.ListObservedDecisionsRequest,
                observed_pb2.ListObservedDecisionsResponse.SerializeToString,
            ),
        }

    def worker_handlers(self) -> dict[str, Handler]:
        """The handlers of the methods only the primary serves, by name: those that need the
        workers, and the observed decisions."""
        return {
            **self.observed_handlers(),
            "ConvertWeights": grpc.stream_stream_rpc_method_handler(
                self.ConvertWeights,
                request_deserializer=pb.ConvertWeightsRequest.FromString,
                response_serializer=pb.ConvertWeightsResponse.SerializeToString,
            ),
            "RunMoE": _unary(self.RunMoE, pb.RunMoERequest, _as_bytes),
            "GetPlatform": _unary(
                self.GetPlatform, pb.GetPlatformRequest, pb.GetPlatformResponse.SerializeToString
            ),
            "ListWorkers": _unary(
                self.ListWorkers, pb.ListWorkersRequest, pb.ListWorkersResponse.SerializeToString
            ),
            "ListLayers": _unary(
                self.ListLayers, pb.ListLayersRequest, pb.ListLayersResponse.SerializeToString
            ),
            "UnloadLayer": _unary(
                self.UnloadLayer, pb.UnloadLayerRequest, pb.UnloadLayerResponse.SerializeToString
            ),
        }

    def handlers(self) -> dict[str, Handler]:
        """Every method's handler, by name, each once."""
        return {**self.selection.handlers(), **self.worker_handlers()}


def add_to_server(servicer: MoeControlServicer, server: Any) -> None:
    """Register every method of the service on `server` (a grpc.aio server, or a
    HandlerRegistrar in front of one)."""
    server.add_registered_method_handlers(SERVICE_NAME, servicer.handlers())
