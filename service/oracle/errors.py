"""Domain errors of the oracle.

They know nothing of gRPC or of the CLI: the API layer maps them to status codes in one
interceptor, the CLI maps them to exit codes and JSON. Two families matter to users:

* `InvalidSpecError`: the request itself is wrong (a missing field, an unknown method, bits
  vLLM does not know). It names each offending field and what would be allowed.
* `SelectionError`: the request is well formed, but vLLM 0.33 itself would refuse this
  deployment (a forced backend that does not fit, no eligible backend, a quantization config
  vLLM rejects). It carries vLLM's exception class name and exact message, and the
  per-backend verdicts that led there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.errors import MoeControlError

if TYPE_CHECKING:
    from service.oracle.decision import Candidate


class OracleError(MoeControlError):
    """Base class of every error the oracle raises on purpose."""


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad field of a request: its dotted path and what is wrong with it."""

    field: str
    description: str


class InvalidSpecError(OracleError):
    """The deployment spec is malformed; each violation names a field and the allowed values."""

    def __init__(self, violations: Iterable[FieldViolation]) -> None:
        self.violations = tuple(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    @classmethod
    def single(cls, field: str, description: str) -> InvalidSpecError:
        return cls([FieldViolation(field, description)])


class UnknownRulesetError(InvalidSpecError):
    """The requested ruleset (vLLM release) is not one the oracle carries."""


#: Where in vLLM's start-up path a `SelectionError` arises (`ErrorInfo.stage`).
STAGES = ("quantization", "capability", "moe_method", "backend")
#: The exception classes vLLM raises there (`ErrorInfo.type`).
VLLM_EXCEPTIONS = ("ValueError", "NotImplementedError", "AssertionError")


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """What vLLM would raise: where in its start-up path, which exception class, which text.

    `stage` is one of `STAGES`: "quantization" (resolving or parsing the quantization config),
    "capability" (the quant method's minimum compute capability), "moe_method" (building the
    MoE quant method) and "backend" (the WNA16 backend selection itself).
    """

    stage: str
    type: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"stage": self.stage, "type": self.type, "message": self.message}


class SelectionError(OracleError):
    """vLLM 0.33 itself fails this deployment; the error says where and why, exactly."""

    def __init__(
        self,
        error: ErrorInfo,
        *,
        candidates: tuple[Candidate, ...] = (),
        quantization: str | None = None,
        moe_method: str | None = None,
    ) -> None:
        self.error = error
        self.candidates = candidates
        self.quantization = quantization
        self.moe_method = moe_method
        super().__init__(f"{error.type}: {error.message}")

    def to_json(self) -> dict[str, object]:
        return {
            "quantization": self.quantization,
            "moe_method": self.moe_method,
            "error": self.error.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
        }
