"""The oracle's answer: which backend a MoE layer gets, and why every other one did not."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    """What happened to one backend of the priority list."""

    SELECTED = "selected"
    REJECTED = "rejected"
    #: vLLM stopped before this backend; the reason is what it would have been told.
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

    `reason_code` and `reason` are empty when nothing stands against the backend (it was
    selected, or it was not reached and would have been eligible).
    """

    backend: str
    verdict: Verdict
    reason_code: str = ""
    reason: str = ""

    @property
    def eligible(self) -> bool:
        return not self.reason

    def to_json(self) -> dict[str, str]:
        return {
            "backend": self.backend,
            "verdict": self.verdict.value,
            "reason_code": self.reason_code,
            "reason": self.reason,
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
    (the layer is left unquantized by a skip list or a dynamic rule).
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

    def to_json(self) -> dict[str, Any]:
        return {
            "ruleset": self.ruleset,
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
        }
