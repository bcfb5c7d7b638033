"""SelectMatrix's codec: a request's every bad part is INVALID_ARGUMENT naming its field
(the cell limit included, as POST /v1/select:matrix has it), and a matrix survives the
trip to the wire and back cell for cell."""

from __future__ import annotations

import json
import math

import pytest

from service.api.codecs.matrix import cell_from_pb, matrix_query, matrix_response
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.matrix import decide_matrix
from service.dataplane.matrix import MAX_MATRIX_CELLS, MatrixModel, MatrixQuery
from service.dataplane.offload import Budget
from service.dataplane.selection import Selector
from service.metrics import Metrics
from service.oracle import DEFAULT_RULESET, InvalidSpecError
from tests.api.test_servicer import GPTQ, LAYER, Platforms

SPEC = json.dumps({"hf_quantization_config": GPTQ, "layer": LAYER})


def request(**fields: object) -> pb.SelectMatrixRequest:
    base: dict[str, object] = {
        "models": [pb.MatrixModel(label="a", spec_json=SPEC)],
        "gpus": ["a100"],
    }
    return pb.SelectMatrixRequest(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"models": []}, "models"),
        ({"models": [pb.MatrixModel(label="", spec_json=SPEC)]}, "models[0].label"),
        ({"models": [pb.MatrixModel(label="a", spec_json="{")]}, "models[0].spec_json"),
        ({"models": [pb.MatrixModel(label="a", spec_json="[]")]}, "models[0].spec_json"),
        ({"models": [pb.MatrixModel(label="a", spec_json=SPEC)] * 2}, "models"),
        ({"gpus": []}, "gpus"),
        ({"gpus": ["a100", "no-such-gpu"]}, "gpus[1]"),
        ({"rulesets": ["vllm-9.9"]}, "rulesets[0]"),
        ({"platform_json": "[1]"}, "platform_json"),
        (
            {
                "models": [
                    pb.MatrixModel(label=str(i), spec_json=SPEC)
                    for i in range(MAX_MATRIX_CELLS + 1)
                ]
            },
            "models",
        ),
    ],
)
def test_a_bad_request_names_its_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError) as refused:
        matrix_query(request(**fields))
    assert [v.field for v in refused.value.violations] == [field]


def test_a_request_reads_as_its_query() -> None:
    query = matrix_query(request(gpus=["a100", "h100", "a100"], platform_json='{"packages": []}'))
    assert query.gpus == ["a100", "h100"]
    assert query.rulesets == [DEFAULT_RULESET]
    assert query.platform == {"packages": []}
    assert query.models[0].spec == json.loads(SPEC)


def test_every_cell_survives_the_wire() -> None:
    models = [
        MatrixModel("gptq", "here", json.loads(SPEC)),
        MatrixModel("bad", "here", {"layer": LAYER}),
    ]
    query = MatrixQuery(models, ["a100", "mi300x", "cpu"], [DEFAULT_RULESET])
    matrix = decide_matrix(Selector(Platforms(None), Metrics()), None, query, Budget(math.inf))
    assert {cell.outcome for cell in matrix.cells} >= {"chosen", "invalid"}
    wire = pb.SelectMatrixResponse.FromString(matrix_response(matrix).SerializeToString())
    assert tuple(cell_from_pb(cell) for cell in wire.cells) == matrix.cells
