"""The oracle's answer: which backend a MoE layer gets, and why every other one did not."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.oracle.platform import PlatformProfile


class Verdict(StrEnum):
    """What happened to one backend of the priority list."""

    SELECTED = "selected"
    #: vLLM tried this backend and turned it down; the reason is vLLM's.
    REJECTED = "rejected"
    #: vLLM never tried this backend (an earlier one won, or another was forced): vLLM
    #: gives no reason, so there is none; the explanation says why it was not tried.
    NOT_REACHED = "not_reached"


@dataclass(frozen=True, slots=True)
class WeightKey:
    """vLLM's weight `QuantKey`, in plain values (scalar type name, scale group shape)."""

    dtype: str
    scale_dtype: str
    group_shape: tuple[int, int]
    symmetric: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "scale_dtype": self.scale_dtype,
            "group_shape": list(self.group_shape),
            "symmetric": self.symmetric,
        }

    def __str__(self) -> str:
        rows, cols = self.group_shape
        sym = "sym" if self.symmetric else "asym"
        return f"{self.dtype}/{self.scale_dtype}({rows},{cols})/{sym}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One backend's verdict, with a stable reason code and vLLM's exact reason text.

    `reason_code` and `reason` are set only where vLLM tried the backend and rejected it.
    `explanation` says the same in a user's terms where vLLM's text misleads or says
    nothing (a missing package reported as a device, a property of the integration rather
    than the checkpoint, why a backend was not tried); it never replaces `reason`.
    """

    backend: str
    verdict: Verdict
    reason_code: str = ""
    reason: str = ""
    explanation: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "backend": self.backend,
            "verdict": self.verdict.value,
            "reason_code": self.reason_code,
            "reason": self.reason,
            "explanation": self.explanation,
        }


@dataclass(frozen=True, slots=True)
class Change:
    """One change of the fixed set a user can make (`service.oracle.changes.CHANGES`).

    `kind` groups it (package, env, moe_backend, quantization, checkpoint, parallel,
    platform), `field` and `value` say it as data (the spec field and its new value), and
    `text` says it as a user would do it ("install humming-kernels").
    """

    kind: str
    field: str
    value: str
    text: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "field": self.field, "value": self.value, "text": self.text}


@dataclass(frozen=True, slots=True)
class ChangeHint:
    """A smallest set of changes that makes `backend` the winner (`outcome` "selected") or,
    where nothing of the set makes it win, at least eligible (`outcome` "eligible")."""

    backend: str
    outcome: str
    changes: tuple[Change, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "outcome": self.outcome,
            "changes": [c.to_json() for c in self.changes],
        }


@dataclass(frozen=True, slots=True)
class Hazard:
    """A known vLLM misbehaviour on the chosen path; the decision itself stays vLLM's."""

    code: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True, slots=True)
class Decision:
    """vLLM's choice for one MoE layer, with its inputs resolved and every backend's verdict.

    `backend` and `experts_class` are None when vLLM builds no WNA16 method for the layer
    (the layer is left unquantized by a skip list or a dynamic rule); `explanation` then
    says which. `platform` is the platform the decision was made for. `what_would_change`
    is None unless asked for (`select(..., what_would_change=True)`).
    """

    ruleset: str
    quantization: str
    moe_method: str
    backend: str | None
    experts_class: str | None
    weight_key: WeightKey | None = None
    may_have_zp: bool | None = None
    may_have_bias: bool | None = None
    allow_tile_padding: bool | None = None
    candidates: tuple[Candidate, ...] = ()
    hazards: tuple[Hazard, ...] = field(default=())
    platform: PlatformProfile | None = None
    explanation: str = ""
    what_would_change: tuple[ChangeHint, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "ruleset": self.ruleset,
            "platform": None if self.platform is None else self.platform.to_json(),
            "quantization": self.quantization,
            "moe_method": self.moe_method,
            "backend": self.backend,
            "experts_class": self.experts_class,
            "weight_key": self.weight_key.to_json() if self.weight_key else None,
            "may_have_zp": self.may_have_zp,
            "may_have_bias": self.may_have_bias,
            "allow_tile_padding": self.allow_tile_padding,
            "candidates": [c.to_json() for c in self.candidates],
            "hazards": [h.to_json() for h in self.hazards],
            "explanation": self.explanation,
            "what_would_change": hints_json(self.what_would_change),
        }


def hints_json(hints: tuple[ChangeHint, ...] | None) -> list[dict[str, Any]] | None:
    return None if hints is None else [h.to_json() for h in hints]
