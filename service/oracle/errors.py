"""Domain errors of the oracle.

They know nothing of gRPC or of the CLI: the API layer maps them to status codes in one
interceptor, the CLI maps them to exit codes and JSON. Two families matter to users:

* `InvalidSpecError`: the request itself is wrong (a missing field, an unknown method, bits
  vLLM does not know). It names each offending field and what would be allowed.
* `SelectionError`: the request is well formed, but the release itself would refuse this
  deployment (a forced backend that does not fit, no eligible backend, a quantization config
  vLLM rejects). It carries vLLM's exception class name and exact message, and the
  per-backend verdicts that led there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.oracle.invalid import (
    FieldViolation,
    InvalidSpecError,
    OracleError,
    UnknownRulesetError,
)

__all__ = [
    "ErrorInfo",
    "FieldViolation",
    "InvalidSpecError",
    "OracleError",
    "SelectionError",
    "UnknownRulesetError",
]

if TYPE_CHECKING:
    from service.oracle.decision import Candidate, ChangeHint
    from service.oracle.platform import PlatformProfile


#: Where in vLLM's start-up path a `SelectionError` arises (`ErrorInfo.stage`).
STAGES = (
    "kernel_config",
    "environment",
    "quantization",
    "capability",
    "platform",
    "moe_method",
    "backend",
)
#: The exception classes vLLM raises there (`ErrorInfo.type`).
VLLM_EXCEPTIONS = (
    "ValueError",
    "NotImplementedError",
    "AssertionError",
    "ArgumentError",
    "TypeError",
    "ValidationError",
    "KeyError",
    "RuntimeError",
)


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """What vLLM would raise: where in its start-up path, which exception class, which text.

    `stage` is one of `STAGES`, in start-up order: "kernel_config" (`vllm serve` refusing a
    `--moe-backend` name), "environment" (`Platform.validate_environ` refusing a removed or
    retired `VLLM_*` variable), "quantization" (resolving or parsing the quantization config),
    "capability" (the quant method's minimum compute capability), "platform" (the platform's
    `check_and_update_config` refusing the machine), "moe_method" (building the MoE quant
    method) and "backend" (the WNA16 backend selection itself).
    """

    stage: str
    type: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"stage": self.stage, "type": self.type, "message": self.message}


class SelectionError(OracleError):
    """The release itself fails this deployment; the error says where and why, exactly.

    The engine sets `ruleset` and `platform` (what the failed answer was decided by and
    for) and, when asked, `what_would_change`.
    """

    def __init__(
        self,
        error: ErrorInfo,
        *,
        candidates: tuple[Candidate, ...] = (),
        quantization: str | None = None,
        moe_method: str | None = None,
        ruleset: str | None = None,
        platform: PlatformProfile | None = None,
        what_would_change: tuple[ChangeHint, ...] | None = None,
    ) -> None:
        self.error = error
        self.candidates = candidates
        self.quantization = quantization
        self.moe_method = moe_method
        self.ruleset = ruleset
        self.platform = platform
        self.what_would_change = what_would_change
        super().__init__(f"{error.type}: {error.message}")

    def to_json(self) -> dict[str, object]:
        return {
            "ruleset": self.ruleset,
            "platform": None if self.platform is None else self.platform.to_json(),
            "quantization": self.quantization,
            "moe_method": self.moe_method,
            "error": self.error.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "what_would_change": (
                None
                if self.what_would_change is None
                else [h.to_json() for h in self.what_would_change]
            ),
        }
