"""Each route's call into the data plane: the very calls the gRPC servicer makes.

`POST /v1/select` and every matrix cell go through the process's `Selector`
(service.dataplane.selection, the one gRPC's SelectBackend uses: same decisions, same
metrics); the listings are the servicer's own messages (`SelectionServicer.presets` and
`.rulesets`) and the primary's ListWorkers / ListLayers / ListObservedDecisions answers
(state.py), turned into the CLI's JSON by `service.api.codecs.messages`. Nothing here
decides anything itself.

A handler takes the `Plane` and the request (`Call`: the parsed JSON body, the query) and
returns the JSON answer, or a `Reply` where the status is not 200; errors are raised as
domain exceptions and answered by the endpoint (errors.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from service.api.codecs.answer_cache import AnswerCache, CachedAnswer
from service.api.codecs.messages import layers_json, message_json, presets_json, workers_json
from service.api.codecs.rulesets import rulesets_from_pb
from service.api.matrix import decide_matrix, encode
from service.dataplane.matrix import to_json as matrix_json
from service.dataplane.offload import Budget, Offload
from service.dataplane.selection import Selector
from service.dataplane.upgrade import diff as diff_rulesets
from service.http import codecs
from service.http.errors import bad_body
from service.http.state import PrimaryState


@dataclass(frozen=True, slots=True)
class Plane:
    """What the handlers call: the process's selector, the servicer's preset and ruleset
    messages, the primary's workers, layers and observed decisions (state.py: its own in the
    primary, asked of it in a replica), readiness as gRPC health says it."""

    selector: Selector
    presets: Any
    rulesets: Any
    state: PrimaryState
    ready: Callable[[], bool]
    #: The OpenAPI document (GET /v1/openapi.json).
    document: Any = None
    #: POST /v1/select's kept answers (JSON bytes by body bytes, while no worker changes),
    #: as gRPC's SelectBackend keeps its own (`--select-cache-mib`); None: off.
    cache: AnswerCache | None = None
    #: Where CPU-heavy work runs, off the event loop (the process's gRPC server's own).
    offload: Offload = field(default_factory=Offload)


@dataclass(frozen=True, slots=True)
class Call:
    """One request as a handler sees it: the body's bytes (read within the size limit;
    the handler parses them) and the query."""

    raw: bytes = b""
    query: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Encoded:
    """An answer already encoded as JSON bytes (a kept answer)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer with its own HTTP status."""

    status: int
    body: Any


async def select(plane: Plane, call: Call) -> Any:
    """POST /v1/select: `moe-control select --json`'s answer for one spec. The same body
    while no worker changed is answered from the kept bytes (its decision counted again),
    as SelectBackend's answer cache does; only answers are kept, errors decided again."""
    cache, generation = plane.cache, plane.selector.generation
    if cache is not None:
        kept = cache.get(call.raw, generation)
        if kept is not None:
            for counter in kept.counters:
                counter.inc()
            return Encoded(kept.payload)

    def decide(budget: Budget) -> Encoded:
        # Off the loop: a spec up to the body limit parsed, the what-would-change search.
        budget.check("the decision")
        query = codecs.select_query(codecs.parse_json(call.raw))
        answer, counters = plane.selector.decide(query)
        payload = encode(codecs.answer_json(query, answer))
        if cache is not None:
            cache.put(call.raw, CachedAnswer(generation, payload, counters))
        return Encoded(payload)

    return await plane.offload.run(decide)


async def select_matrix(plane: Plane, call: Call) -> Any:
    """POST /v1/select:matrix: configs x GPUs x rulesets, each cell decided as a single
    select decides it (`select --config DIR --gpu A,B --ruleset X,Y --json`). A cell's
    answer is kept in the answer cache as POST /v1/select's are (by its spec and ruleset,
    while no worker changed; its decision, or vLLM's failure, counted again when served
    again), so a matrix asked again, or one that shares rows with an earlier one, decides
    only its new cells; invalid specs are checked again (service.api.matrix, as gRPC's
    SelectMatrix). Cells the time budget did not reach say so."""

    def decide(budget: Budget) -> Encoded:
        # Off the loop, all of it: the body parsed, every cell, the answer encoded.
        query = codecs.matrix_request(codecs.parse_json(call.raw))
        table = decide_matrix(plane.selector, plane.cache, query, budget)
        return Encoded(encode(matrix_json(table)))

    return await plane.offload.run(decide)


async def diff(plane: Plane, call: Call) -> Any:
    """POST /v1/diff: the deployment under every ruleset from "from" to "to", both answers
    and what differs, each difference with its cause, those of the "fail_on" fields apart
    from the others (`moe-control diff --json`; the data plane DiffRulesets calls)."""

    def decide(budget: Budget) -> Any:
        budget.check("the diff")
        query = codecs.diff_query(codecs.parse_json(call.raw))
        return diff_rulesets(plane.selector, query).to_json(query.fail_on)

    return await plane.offload.run(decide)


async def platforms(plane: Plane, call: Call) -> Any:
    """GET /v1/platforms: the presets, as `moe-control presets --json`."""
    return presets_json(plane.presets)


async def rulesets(plane: Plane, call: Call) -> Any:
    """GET /v1/rulesets: the rulesets, as `moe-control rulesets --json`."""
    return rulesets_from_pb(plane.rulesets)


async def workers(plane: Plane, call: Call) -> Any:
    """GET /v1/workers: as `moe-control workers --json`."""
    return workers_json(await plane.state.workers())


def _worker_index(query: Mapping[str, str]) -> int | None:
    text = query.get("worker_index")
    if text is None:
        return None
    if not text.isdigit():
        raise bad_body("worker_index", f"a worker's index (0, 1, ...), got {text!r}")
    return int(text)


async def layers(plane: Plane, call: Call) -> Any:
    """GET /v1/layers[?worker_index=N]: as `moe-control layers --json`."""
    return layers_json(await plane.state.layers(_worker_index(call.query)))


async def observed(plane: Plane, call: Call) -> Any:
    """GET /v1/observed[?mismatches=true]: as `moe-control observed --json`."""
    flag = call.query.get("mismatches", "false").lower()
    if flag not in ("true", "false", "1", "0"):
        raise bad_body("mismatches", f"true or false, got {flag!r}")
    return message_json(await plane.state.observed(flag in ("true", "1")))


async def healthz(plane: Plane, call: Call) -> Any:
    """GET /healthz: liveness (gRPC health's "" service): SERVING while the process runs."""
    return {"status": "SERVING"}


async def readyz(plane: Plane, call: Call) -> Any:
    """GET /readyz: readiness as gRPC health says it for moe_control.v1.MoeControlService:
    200 SERVING while a worker is ready and the server is not stopping, else 503."""
    if plane.ready():
        return {"status": "SERVING"}
    return Reply(503, {"status": "NOT_SERVING"})
