"""vLLM's WNA16 MoE backend decision as a pure-Python library (no torch, grpc or vLLM).

`select(spec)` answers which backend and experts class vLLM 0.33 gives a MoE layer, with
every other backend's verdict, vLLM's exact reason text and an explanation beside it, the
platform and ruleset it was decided for, and, on request, what would change the decision.
"""

from service.oracle.decision import (
    Candidate,
    Change,
    ChangeHint,
    Decision,
    Hazard,
    Verdict,
    WeightKey,
)
from service.oracle.errors import (
    ErrorInfo,
    FieldViolation,
    InvalidSpecError,
    OracleError,
    SelectionError,
    UnknownRulesetError,
)
from service.oracle.model_config import deployment_from_model_config
from service.oracle.platform import PLATFORM_PRESETS, PlatformProfile, preset
from service.oracle.rulesets import DEFAULT_RULESET, RULESETS, Release, Ruleset, resolve_ruleset
from service.oracle.selection import select
from service.oracle.spec import DeploymentSpec, parse_deployment

__all__ = [
    "DEFAULT_RULESET",
    "PLATFORM_PRESETS",
    "RULESETS",
    "Candidate",
    "Change",
    "ChangeHint",
    "Decision",
    "DeploymentSpec",
    "ErrorInfo",
    "FieldViolation",
    "Hazard",
    "InvalidSpecError",
    "OracleError",
    "PlatformProfile",
    "Release",
    "Ruleset",
    "SelectionError",
    "UnknownRulesetError",
    "Verdict",
    "WeightKey",
    "deployment_from_model_config",
    "parse_deployment",
    "preset",
    "resolve_ruleset",
    "select",
]
