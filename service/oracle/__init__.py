"""vLLM's WNA16 MoE backend decision as a pure-Python library (no torch, grpc or vLLM).

`select(spec)` answers which backend and experts class vLLM 0.33 gives a MoE layer, with
every other backend's verdict and vLLM's exact reason text.
"""

from service.oracle.decision import Candidate, Decision, Hazard, Verdict, WeightKey
from service.oracle.engine import select
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
from service.oracle.rulesets import DEFAULT_RULESET, RULESETS
from service.oracle.spec import DeploymentSpec, parse_deployment

__all__ = [
    "DEFAULT_RULESET",
    "PLATFORM_PRESETS",
    "RULESETS",
    "Candidate",
    "Decision",
    "DeploymentSpec",
    "ErrorInfo",
    "FieldViolation",
    "Hazard",
    "InvalidSpecError",
    "OracleError",
    "PlatformProfile",
    "SelectionError",
    "UnknownRulesetError",
    "Verdict",
    "WeightKey",
    "deployment_from_model_config",
    "parse_deployment",
    "preset",
    "select",
]
