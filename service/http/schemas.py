"""Every JSON Schema of the HTTP/JSON API, declared once (JSON Schema 2020-12, as OpenAPI
3.1 takes it). The route table (routes.py) names them; the OpenAPI document (openapi.py)
publishes them under `components.schemas`. Enumerations come from their one source in the
code: the verdicts from the oracle, the matrix outcomes from the data plane, the GPUs from
the presets."""

from __future__ import annotations

from typing import Any

from service.dataplane.matrix import OUTCOMES
from service.oracle import PLATFORM_PRESETS, RULESETS
from service.oracle.decision import Verdict
from service.oracle.errors import STAGES
from service.oracle.gate import DEFAULT_FAIL_ON, GATE_FIELDS


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}
_OBJECT = {"type": "object"}

SCHEMAS: dict[str, dict[str, Any]] = {
    "Platform": {
        "type": "object",
        "description": "A platform profile (a preset's, a worker's, or one spelled out).",
        "properties": {
            "device": _STRING,
            "capability": _NULLABLE_STRING,
            "arch": _NULLABLE_STRING,
            "amx": {"type": "boolean"},
            "x86": {"type": "boolean"},
            "packages": {"type": "array", "items": _STRING},
            "env": {"type": "object", "additionalProperties": _STRING},
            "name": _NULLABLE_STRING,
            "preset": _NULLABLE_STRING,
        },
    },
    "DeploymentSpec": {
        "type": "object",
        "description": "A deployment spec, as `moe-control select --deployment` reads it "
        "(docs/selecting.md); or a model's config.json under `config`, the other fields "
        "laid over the spec derived from it.",
        "properties": {
            "config": {**_OBJECT, "description": "a model's config.json"},
            "hf_quantization_config": _OBJECT,
            "quantization": _NULLABLE_STRING,
            "layer": _OBJECT,
            "parallel": _OBJECT,
            "platform": {
                "description": "a preset's name (GET /v1/platforms) or a profile; absent: "
                "worker 0's own",
                "oneOf": [{"type": "string", "enum": list(PLATFORM_PRESETS)}, ref("Platform")],
            },
            "moe_backend": _NULLABLE_STRING,
            "lora": {"type": "boolean"},
            "ruleset": {"type": "string", "examples": list(RULESETS)},
            "id": {"description": "echoed first in the answer"},
        },
    },
    "Candidate": {
        "type": "object",
        "required": ["backend", "verdict"],
        "properties": {
            "backend": _STRING,
            "verdict": {"type": "string", "enum": [v.value for v in Verdict]},
            "reason_code": _STRING,
            "reason": {**_STRING, "description": "vLLM's own words"},
            "explanation": {**_STRING, "description": "what it means, where vLLM misleads"},
        },
    },
    "Hazard": {"type": "object", "properties": {"code": _STRING, "message": _STRING}},
    "SelectAnswer": {
        "type": "object",
        "description": "`moe-control select --json`'s answer.",
        "required": ["ruleset", "backend", "candidates"],
        "properties": {
            "id": {},
            "ruleset": _STRING,
            "platform": ref("Platform"),
            "quantization": _NULLABLE_STRING,
            "moe_method": _NULLABLE_STRING,
            "backend": {**_NULLABLE_STRING, "description": "null: the layer stays unquantized"},
            "experts_class": _NULLABLE_STRING,
            "weight_key": {"type": ["object", "null"]},
            "may_have_zp": {"type": ["boolean", "null"]},
            "may_have_bias": {"type": ["boolean", "null"]},
            "allow_tile_padding": {"type": ["boolean", "null"]},
            "candidates": {"type": "array", "items": ref("Candidate")},
            "hazards": {"type": "array", "items": ref("Hazard")},
            "explanation": _NULLABLE_STRING,
            "what_would_change": {"type": ["array", "null"], "items": _OBJECT},
        },
    },
    "SelectFailure": {
        "type": "object",
        "description": "`moe-control select --json`'s answer where vLLM itself fails the "
        "deployment: where, which exception, vLLM's message, and the verdicts so far.",
        "required": ["ruleset", "error", "candidates"],
        "properties": {
            "id": {},
            "ruleset": _STRING,
            "platform": {"oneOf": [ref("Platform"), {"type": "null"}]},
            "quantization": _NULLABLE_STRING,
            "moe_method": _NULLABLE_STRING,
            "error": {
                "type": "object",
                "required": ["stage", "type", "message"],
                "properties": {
                    "stage": {"type": "string", "enum": list(STAGES)},
                    "type": _STRING,
                    "message": {**_STRING, "description": "vLLM's own words"},
                },
            },
            "candidates": {"type": "array", "items": ref("Candidate")},
            "what_would_change": {"type": ["array", "null"], "items": _OBJECT},
        },
    },
    "DiffRequest": {
        "type": "object",
        "required": ["from", "to", "deployment"],
        "properties": {
            "from": {"type": "string", "examples": list(RULESETS)},
            "to": {"type": "string", "examples": list(RULESETS)},
            "deployment": ref("DeploymentSpec"),
            "fail_on": {
                "type": "array",
                "items": {"type": "string", "enum": list(GATE_FIELDS)},
                "description": "the fields whose change sets `changed` (a CI gate fails on "
                f"them); absent or empty: {', '.join(DEFAULT_FAIL_ON)}",
            },
        },
    },
    "Difference": {
        "type": "object",
        "required": ["field", "before", "after", "cause"],
        "properties": {
            "field": {
                "type": "string",
                "description": '"backend", "experts_class", "error" or "verdict.<BACKEND>"',
            },
            "before": {
                **_STRING,
                "description": 'the value under "from"; "" for none. A verdict reads '
                '"selected", "not_reached" or "rejected <REASON_CODE>", an error '
                '"<stage>: <type>: <message>"',
            },
            "after": {**_STRING, "description": 'the value under "to"'},
            "cause": {
                **_STRING,
                "description": "the rule or priority that moved it, naming the ruleset",
            },
        },
    },
    "Diff": {
        "type": "object",
        "description": "`moe-control diff --json`'s answer for one deployment. Every ruleset "
        "between the two is answered too, so that each cause names the release that brings "
        "it. The answers are `POST /v1/select`'s (what_would_change null: not searched), or "
        "where vLLM fails, the failure `select --json` prints.",
        "required": [
            "from",
            "to",
            "fail_on",
            "changed",
            "before",
            "after",
            "differences",
            "other_differences",
        ],
        "properties": {
            "from": _STRING,
            "to": _STRING,
            "fail_on": {
                "type": "array",
                "items": {"type": "string", "enum": list(GATE_FIELDS)},
                "description": "the fields gated on (the request's, else the default)",
            },
            "changed": {
                "type": "boolean",
                "description": "whether a field of fail_on changes (what a CI gate fails on)",
            },
            "before": {"oneOf": [ref("SelectAnswer"), ref("SelectFailure")]},
            "after": {"oneOf": [ref("SelectAnswer"), ref("SelectFailure")]},
            "differences": {
                "type": "array",
                "items": ref("Difference"),
                "description": "the differences that touch a field of fail_on",
            },
            "other_differences": {
                "type": "array",
                "items": ref("Difference"),
                "description": "every other difference (by default a backend's verdict, an "
                "error's wording): answered apart, never setting changed",
            },
        },
    },
    "MatrixRequest": {
        "type": "object",
        "required": ["configs", "gpus"],
        "properties": {
            "configs": {
                "description": "the models: a list of {name, config}, or {name: config}",
                "oneOf": [
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["config"],
                            "properties": {"name": _STRING, "config": _OBJECT},
                        },
                    },
                    {"type": "object", "additionalProperties": _OBJECT},
                ],
            },
            "gpus": {
                "oneOf": [
                    {"type": "array", "items": {"type": "string", "enum": list(PLATFORM_PRESETS)}},
                    {"const": "all"},
                ]
            },
            "rulesets": {
                "type": "array",
                "items": {"type": "string", "examples": list(RULESETS)},
                "description": "default: the newest release",
            },
        },
    },
    "MatrixCell": {
        "type": "object",
        "properties": {
            "model": _STRING,
            "ruleset": _STRING,
            "gpu": _STRING,
            "outcome": {"type": "string", "enum": list(OUTCOMES)},
            "backend": _NULLABLE_STRING,
            "hazards": {"type": "array", "items": ref("Hazard")},
            "problem": _NULLABLE_STRING,
            "platform": {"oneOf": [ref("Platform"), {"type": "null"}]},
        },
    },
    "Matrix": {
        "type": "object",
        "description": "`moe-control select --config ... --gpu A,B --json`'s matrix.",
        "properties": {
            "gpus": {"type": "array", "items": _STRING},
            "rulesets": {"type": "array", "items": _STRING},
            "models": {
                "type": "array",
                "items": {"type": "object", "properties": {"label": _STRING, "origin": _STRING}},
            },
            "cells": {"type": "array", "items": ref("MatrixCell")},
        },
    },
    "Presets": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": _STRING, "profile": ref("Platform")},
        },
    },
    "Rulesets": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": _STRING,
                "default": {"type": "boolean"},
                "vllm": _STRING,
                "first_version": _STRING,
                "below_version": _STRING,
                "torch": _STRING,
                "humming_kernels": _STRING,
                "backends": {"type": "array", "items": _STRING},
                "moe_backends": {"type": "array", "items": _STRING},
            },
        },
    },
    "Workers": {
        "type": "object",
        "description": "`moe-control workers --json`: ListWorkers in protobuf's JSON mapping "
        "(proto field names).",
        "properties": {
            "ready": {"type": "boolean"},
            "ready_workers": {"type": "integer"},
            "workers": {"type": "array", "items": _OBJECT},
        },
    },
    "Observed": {
        "type": "object",
        "description": "`moe-control observed --json`: ListObservedDecisions in protobuf's "
        "JSON mapping (proto field names), most recently reported first.",
        "properties": {
            "deployments": {"type": "array", "items": _OBJECT},
            "evicted": {"type": "integer"},
        },
    },
    "Layers": {
        "type": "array",
        "description": "`moe-control layers --json`: the kept layers.",
        "items": _OBJECT,
    },
    "Health": {
        "type": "object",
        "properties": {"status": {"type": "string", "enum": ["SERVING", "NOT_SERVING"]}},
    },
    "Error": {
        "type": "object",
        "description": "A google.rpc.Status as JSON (AIP-193): `code` the HTTP status, "
        "`status` the gRPC code's name, `details` its packed details (`@type` and the "
        "message's fields, proto names).",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "status", "message", "details"],
                "properties": {
                    "code": {"type": "integer"},
                    "status": _STRING,
                    "message": _STRING,
                    "details": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["@type"],
                            "properties": {"@type": _STRING},
                        },
                    },
                },
            }
        },
    },
    "OpenApi": {"type": "object", "description": "this document"},
}
