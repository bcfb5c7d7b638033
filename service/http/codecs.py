"""Request JSON in, answer JSON out: what each route reads from its body and the JSON it
answers, in the shapes the CLI's `--json` prints (so a script can switch between
`moe-control ... --json` and curl).

`POST /v1/select` takes a deployment spec (what `select --deployment` reads), or a model's
config.json as {"config": {...}, "platform": ..., ...}: the spec
`deployment_from_model_config` derives from the config (as `select --config` does), with
the body's other fields (a platform, a ruleset, a moe_backend, ...) laid over it. Its
answer is `select --json`'s, what would change the decision included. A matrix cell is
`service.dataplane.matrix`'s; a listing is `service.api.codecs.messages`' (the CLI's
inventory form).
"""

from __future__ import annotations

from typing import Any

from service.api.matrix import with_id
from service.dataplane.matrix import MatrixQuery, model_from_config, size_problem
from service.dataplane.selection import SelectAnswer, SelectQuery
from service.dataplane.upgrade import DiffQuery
from service.http.errors import bad_body
from service.oracle import (
    DEFAULT_RULESET,
    PLATFORM_PRESETS,
    deployment_from_model_config,
    preset,
    resolve_ruleset,
)
from service.oracle.gate import GATE_FIELDS, parse_fail_on
from service.oracle.json_text import parse_json_object


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, parsed as gRPC parses `spec_json`
    (`parse_json_object`: bad JSON, hostile nesting, out-of-range numbers and a non-object
    name the field `body`); bytes that are not UTF-8 name it too."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_body("body", f"not UTF-8: {exc}") from None
    return parse_json_object(text, "body")


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_body(field, "required: a JSON object")
    return value


def select_query(body: Any) -> SelectQuery:
    """POST /v1/select's body as the data plane's query (a spec's own ruleset decides,
    else the newest release, as `select` without --ruleset)."""
    spec = _object(body, "body")
    if "config" in spec:
        rest = {k: v for k, v in spec.items() if k != "config"}
        spec = {**deployment_from_model_config(_object(spec["config"], "config")), **rest}
    return SelectQuery(spec=spec, what_would_change=True)


def diff_query(body: Any) -> DiffQuery:
    """POST /v1/diff's body, {"from": <ruleset>, "to": <ruleset>, "deployment": <what POST
    /v1/select takes>, "fail_on": [<gate field>, ...] (optional)}, as the data plane's query
    over every ruleset between the two (each name in any spelling the resolver takes; an
    unknown one, or an unknown gate field, names its field)."""
    obj = _object(body, "body")
    names = {}
    for field in ("from", "to"):
        value = obj.get(field)
        if not isinstance(value, str) or not value.strip():
            raise bad_body(field, "required: a ruleset's name (GET /v1/rulesets)")
        names[field] = resolve_ruleset(value, field=field)
    deployment = select_query(_object(obj.get("deployment"), "deployment")).spec
    fail_on = obj.get("fail_on", [])
    if not isinstance(fail_on, list) or not all(isinstance(f, str) for f in fail_on):
        raise bad_body("fail_on", f"a list of field names: {', '.join(GATE_FIELDS)}")
    return DiffQuery.upgrade(
        deployment, names["from"], names["to"], fail_on=parse_fail_on(fail_on, field="fail_on")
    )


def answer_json(query: SelectQuery, answer: SelectAnswer) -> dict[str, Any]:
    """A decision as `select --json` prints it."""
    assert answer.decision is not None
    return with_id(query.spec, answer.decision.to_json())


def _names(value: Any, field: str) -> list[str] | None:
    """A list of names (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad_body(field, "required: a non-empty list of names")
    return list(dict.fromkeys(value))


def matrix_request(body: Any) -> MatrixQuery:
    """POST /v1/select:matrix's body: {"configs": [{"name": ..., "config": {...}}, ...]
    (or {name: config}), "gpus": [...] or "all", "rulesets": [...] (default: the
    newest release)}."""
    obj = _object(body, "body")
    configs = obj.get("configs")
    if isinstance(configs, dict):
        configs = [{"name": name, "config": config} for name, config in configs.items()]
    if not isinstance(configs, list) or not configs:
        raise bad_body("configs", "required: a non-empty list of {name, config}")
    models = []
    for index, item in enumerate(configs):
        entry = _object(item, f"configs[{index}]")
        name = entry.get("name", f"config-{index}")
        if not isinstance(name, str) or not name:
            raise bad_body(f"configs[{index}].name", "a non-empty string")
        config = _object(entry.get("config"), f"configs[{index}].config")
        models.append(model_from_config(name, f"configs[{index}]", config))
    if len({m.label for m in models}) != len(models):
        raise bad_body("configs", "names must be unique")
    gpus = list(PLATFORM_PRESETS) if obj.get("gpus") == "all" else _names(obj.get("gpus"), "gpus")
    if gpus is None:
        raise bad_body("gpus", "required: preset names (GET /v1/platforms) or 'all'")
    for index, gpu in enumerate(gpus):
        preset(gpu, field_name=f"gpus[{index}]")
    named = _names(obj.get("rulesets"), "rulesets") or [DEFAULT_RULESET]
    rulesets = list(
        dict.fromkeys(
            resolve_ruleset(name, field=f"rulesets[{index}]") for index, name in enumerate(named)
        )
    )
    query = MatrixQuery(models, gpus, rulesets)
    problem = size_problem(query.cells)
    if problem is not None:
        raise bad_body("configs", problem)
    return query
