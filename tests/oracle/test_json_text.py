"""JSON text from outside: numbers no deployment could hold are refused naming their path,
everything else parses as `json.loads` parses it."""

from __future__ import annotations

import json

import pytest

from service.oracle import InvalidSpecError, deployment_from_model_config, parse_deployment
from service.oracle.json_text import NotJSONError, parse_json, parse_json_object
from service.oracle.spec import MAX_SIZE

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 1024}
SPEC = {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h100"}


def _with(token: str, *path: str) -> str:
    """SPEC's text with the number at `path` replaced by the raw JSON token `token`."""
    spec = json.loads(json.dumps(SPEC))
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@@"
    return json.dumps(spec).replace('"@@"', token)


def _fields(error: InvalidSpecError) -> list[str]:
    return [v.field for v in error.violations]


def test_ordinary_json_parses_as_json_loads_does() -> None:
    text = json.dumps({**SPEC, "x": [1, -2, 3.5, 1e300, -(2**63), 2**63 - 1, None, True]})
    assert parse_json(text, "body") == json.loads(text)


@pytest.mark.parametrize(
    ("token", "says"),
    [
        ("9" * 5000, "5000 digits"),
        ("-" + "1" * 40, "40 digits"),
        (str(2**63), "beyond a 64-bit integer"),
        ("1e999", "overflows"),
        ("-1e999", "overflows"),
        ("NaN", "NaN is not a JSON number"),
        ("Infinity", "Infinity is not a JSON number"),
        ("-Infinity", "-Infinity is not a JSON number"),
    ],
)
def test_a_number_beyond_any_size_is_refused_naming_its_path(token: str, says: str) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_json(_with(token, "layer", "num_experts"), "spec_json")
    assert _fields(caught.value) == ["spec_json.layer.num_experts"]
    assert says in str(caught.value)
    assert not isinstance(caught.value, NotJSONError)


def test_every_refused_number_is_named_lists_included() -> None:
    text = '{"a": [1, NaN, {"b": 1e400}], "c": ' + "7" * 30 + "}"
    with pytest.raises(InvalidSpecError) as caught:
        parse_json(text, "config", numbers_at="")
    assert _fields(caught.value) == ["a[1]", "a[2].b", "c"]


def test_text_that_is_not_json_is_not_json() -> None:
    for text in ("{", "", "[" * 100_000 + "]" * 100_000):
        with pytest.raises(NotJSONError) as caught:
            parse_json(text, "body")
        assert _fields(caught.value) == ["body"]
    with pytest.raises(InvalidSpecError, match="must be a JSON object"):
        parse_json_object("[1]", "body")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (10**12, f"at most {MAX_SIZE}"),
        (MAX_SIZE + 1, f"at most {MAX_SIZE}"),
        (8.5, "must be an integer"),
        (1e300, "must be an integer"),
        (-4, "must be an integer >= 1"),
        (0, "must be an integer >= 1"),
    ],
)
def test_sizes_no_layer_can_have_are_refused_naming_the_field(value: object, says: str) -> None:
    spec = {**SPEC, "layer": {**LAYER, "num_experts": value}}
    with pytest.raises(InvalidSpecError) as caught:
        parse_deployment(spec)
    # only the bad field: top_k is not compared with a num_experts that is not one
    assert _fields(caught.value) == ["layer.num_experts"]
    assert says in str(caught.value)


def test_the_largest_size_is_accepted() -> None:
    spec = parse_deployment({**SPEC, "layer": {**LAYER, "hidden_size": MAX_SIZE}})
    assert spec.layer.hidden_size == MAX_SIZE


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, 10**400])
def test_a_scaling_factor_must_be_finite(value: float) -> None:
    spec = {**SPEC, "layer": {**LAYER, "routing": {"routed_scaling_factor": value}}}
    with pytest.raises(InvalidSpecError) as caught:
        parse_deployment(spec)
    assert _fields(caught.value) == ["layer.routing.routed_scaling_factor"]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("first_k_dense_replace", float("nan")),
        ("first_k_dense_replace", "three"),
        ("n_group", 8.5),
        ("n_group", -1),
        ("routed_scaling_factor", "x"),
        ("routed_scaling_factor", float("nan")),
        ("routed_scaling_factor", {"a": 1}),
        ("routed_scaling_factor", 10**400),
    ],
)
def test_config_json_numbers_the_spec_derives_from_are_checked(key: str, value: object) -> None:
    config = {
        "hidden_size": 4096,
        "moe_intermediate_size": 1024,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "quantization_config": GPTQ,
        key: value,
    }
    with pytest.raises(InvalidSpecError) as caught:
        deployment_from_model_config(config)
    assert _fields(caught.value) == [f"config.{key}"]
