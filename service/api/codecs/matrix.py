"""SelectMatrix on the wire: its request as the data plane's `MatrixQuery`, a `Matrix` as its
response, and the response's cells as the `Cell`s the CLI renders (so `select --server`
prints a matrix exactly as the local command does)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2
from service.dataplane.matrix import (
    Cell,
    Matrix,
    MatrixModel,
    MatrixQuery,
    size_problem,
)
from service.oracle import (
    DEFAULT_RULESET,
    InvalidSpecError,
    preset,
    resolve_ruleset,
)
from service.oracle.json_text import parse_json_object

#: A cell's outcome (service.dataplane.matrix.OUTCOMES) and its enum value, both ways.
OUTCOME_TO_PB = {
    "chosen": pb.MATRIX_OUTCOME_CHOSEN,
    "unquantized": pb.MATRIX_OUTCOME_UNQUANTIZED,
    "fails": pb.MATRIX_OUTCOME_FAILS,
    "invalid": pb.MATRIX_OUTCOME_INVALID,
    "error": pb.MATRIX_OUTCOME_ERROR,
}
OUTCOME_FROM_PB = {value: name for name, value in OUTCOME_TO_PB.items()}
#: The exit status a cell of each outcome stands for (as the CLI's local matrix gives it).
OUTCOME_EXIT = {"chosen": 0, "unquantized": 0, "fails": 1, "invalid": 2, "error": 3}


def _names(values: Sequence[str], field: str) -> list[str]:
    names = [value.strip() for value in values]
    for index, name in enumerate(names):
        if not name:
            raise InvalidSpecError.single(f"{field}[{index}]", "a non-empty name")
    return list(dict.fromkeys(names))


def matrix_query(request: pb.SelectMatrixRequest) -> MatrixQuery:
    """The request as a query: each model's spec parsed (a bad one names its field),
    labels unique, presets and rulesets known, within the cell limit."""
    if not request.models:
        raise InvalidSpecError.single("models", "required: at least one model")
    models = []
    for index, model in enumerate(request.models):
        if not model.label:
            raise InvalidSpecError.single(f"models[{index}].label", "a non-empty name")
        spec = parse_json_object(model.spec_json, f"models[{index}].spec_json")
        models.append(MatrixModel(model.label, model.origin, spec))
    if len({m.label for m in models}) != len(models):
        raise InvalidSpecError.single("models", "labels must be unique")
    if not request.gpus:
        raise InvalidSpecError.single("gpus", "required: preset names (ListPlatformPresets)")
    gpus = _names(request.gpus, "gpus")
    for index, gpu in enumerate(gpus):
        preset(gpu, field_name=f"gpus[{index}]")
    named = _names(request.rulesets, "rulesets") or [DEFAULT_RULESET]
    rulesets = list(
        dict.fromkeys(
            resolve_ruleset(name, field=f"rulesets[{index}]") for index, name in enumerate(named)
        )
    )
    platform = (
        parse_json_object(request.platform_json, "platform_json") if request.platform_json else {}
    )
    query = MatrixQuery(models, gpus, rulesets, platform)
    problem = size_problem(query.cells)
    if problem is not None:
        raise InvalidSpecError.single("models", problem)
    return query


def matrix_response(matrix: Matrix) -> pb.SelectMatrixResponse:
    """Every cell of `matrix`, in its order."""
    return pb.SelectMatrixResponse(
        cells=[
            pb.MatrixCell(
                model=cell.model,
                ruleset=cell.ruleset,
                gpu=cell.gpu,
                outcome=OUTCOME_TO_PB[cell.outcome],
                backend=cell.backend or "",
                hazards=[
                    selection_pb2.Hazard(code=h["code"], message=h["message"]) for h in cell.hazards
                ],
                problem=cell.problem or "",
                platform_json=json.dumps(cell.platform) if cell.platform is not None else "",
            )
            for cell in matrix.cells
        ],
        rulesets=list(matrix.rulesets),
    )


def cell_from_pb(message: pb.MatrixCell) -> Cell:
    """A response's cell as the data plane's."""
    outcome = OUTCOME_FROM_PB.get(message.outcome, "error")
    return Cell(
        model=message.model,
        ruleset=message.ruleset,
        gpu=message.gpu,
        outcome=outcome,
        backend=message.backend or None,
        hazards=tuple({"code": h.code, "message": h.message} for h in message.hazards),
        problem=message.problem or None,
        exit_code=OUTCOME_EXIT[outcome],
        platform=json.loads(message.platform_json) if message.platform_json else None,
    )
