"""A fleet matrix as a server decides it, on either door (gRPC's SelectMatrix, HTTP's
`POST /v1/select:matrix`): every cell through the process's `Selector` (the decision
SelectBackend makes, counted alike), kept in the process's answer cache by its spec and
ruleset while no worker changes, so a matrix asked again, or one that shares rows with an
earlier one, decides only its new cells (a kept cell's decision, or vLLM's failure,
counted again when it is served again; invalid specs are checked again).

A cell's answer is the JSON a single `select --json` prints and its exit status, the form
service.dataplane.matrix builds a cell from. It runs on an offload thread, within a budget
(service.dataplane.offload): the cells the budget did not reach say so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from service.api.codecs.answer_cache import AnswerCache, CachedAnswer
from service.dataplane.matrix import Matrix, MatrixQuery, build_matrix, lay_over
from service.dataplane.offload import Budget
from service.dataplane.selection import Selector, SelectQuery
from service.oracle import InvalidSpecError, SelectionError, preset

#: A matrix cell's exit-status-like code, as the CLI's matrix keeps them.
OK, FAILS, INVALID = 0, 1, 2
#: Marks a matrix cell's key in an answer cache (no kept request's bytes start like this:
#: neither a JSON body nor a protobuf message).
CELL_KEY = b"\0matrix-cell\0"


def encode(answer: Any) -> bytes:
    """JSON bytes, as every JSON answer is encoded (Starlette's JSONResponse's form:
    UTF-8, compact)."""
    return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def canonical(value: Any) -> bytes:
    """JSON bytes that are the same for equal values whatever their keys' order (a key)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def with_id(spec: Mapping[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The answer with the spec's "id" first, as `select --json` prints it."""
    if "id" in spec:
        return {"id": spec["id"], **result}
    return result


def cell_answer(spec: Mapping[str, Any], outcome: Any) -> tuple[dict[str, Any], int]:
    """A matrix cell's answer from a decision or the error deciding it raised, as the
    CLI's local `answer` gives it (the JSON and its exit status)."""
    if isinstance(outcome, SelectionError):
        return with_id(spec, outcome.to_json()), FAILS
    if isinstance(outcome, InvalidSpecError):
        invalid = [{"field": v.field, "description": v.description} for v in outcome.violations]
        return with_id(spec, {"invalid": invalid}), INVALID
    return with_id(spec, outcome.decision.to_json()), OK


class _CellSpec(dict[str, Any]):
    """A cell's spec with its cache key: the model's canonical JSON, made once per model,
    with the GPU's name and the platform fields."""

    __slots__ = ("key",)

    def __init__(self, spec: Mapping[str, Any], key: bytes) -> None:
        super().__init__(spec)
        self.key = key


def decide_matrix(
    selector: Selector, cache: AnswerCache | None, query: MatrixQuery, budget: Budget
) -> Matrix:
    """Every cell of `query`, kept cells served from `cache`, within `budget`."""
    generation = selector.generation
    overlay = dict(query.platform)
    suffix = b"\0" + canonical(overlay) if overlay else b""
    rows: dict[int, bytes] = {}  # a model's canonical JSON, by its spec (alive till the end)

    def spec_for(spec: Mapping[str, Any], gpu: str) -> dict[str, Any]:
        row = rows.get(id(spec))
        if row is None:
            row = rows[id(spec)] = canonical(spec)
        # A bare preset is named as a single select names it ("platform": "h200": looked
        # up, not parsed again for every cell, and counted under the preset's name).
        platform: Any = lay_over(preset(gpu).to_json(), overlay) if overlay else gpu
        return _CellSpec({**spec, "platform": platform}, row + b"\0" + gpu.encode() + suffix)

    def decide(spec: Mapping[str, Any], ruleset: str) -> tuple[dict[str, Any], int]:
        cell_key = spec.key if isinstance(spec, _CellSpec) else canonical(spec)
        key = CELL_KEY + ruleset.encode() + b"\0" + cell_key
        if cache is not None:
            kept = cache.get(key, generation)
            if kept is not None:
                for counter in kept.counters:
                    counter.inc()
                code, result = json.loads(kept.payload)
                return result, code
        try:
            answer, counters = selector.decide(SelectQuery(spec=dict(spec), ruleset=ruleset))
        except InvalidSpecError as exc:
            return cell_answer(spec, exc)
        except SelectionError as exc:  # vLLM would fail it: as much an answer as a backend
            counters = selector.failure_counters(exc)
            outcome: Any = exc
        else:
            outcome = answer
        result, code = cell_answer(spec, outcome)
        if cache is not None:
            cache.put(key, CachedAnswer(generation, encode([code, result]), counters))
        return result, code

    return build_matrix(
        query.models, query.gpus, query.rulesets, spec_for=spec_for, answer=decide, budget=budget
    )
