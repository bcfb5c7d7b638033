"""The fleet matrix: models by GPUs (by ruleset too), each cell the backend vLLM picks,
hazards marked; transport-free, so every front (the CLI's `select --config`, the HTTP/JSON
API's `POST /v1/select:matrix`, gRPC's SelectMatrix) builds it the same way.

A platform engineer with several checkpoints and a mixed fleet asks one question: which
backend does each model get on each GPU, and where does it break. The matrix asks an answer
function (the oracle, or a server, one SelectBackend per cell) once per model, ruleset and
GPU, the same function a single `select` uses, so a cell says exactly what that single
answer says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.dataplane.offload import BUDGET_SETTING, Budget
from service.oracle import (
    DEFAULT_RULESET,
    PLATFORM_PRESETS,
    RULESETS,
    InvalidSpecError,
    deployment_from_model_config,
    preset,
    resolve_ruleset,
)

#: A matrix has at most this many cells (models x GPUs x rulesets), on every door.
MAX_MATRIX_CELLS = 20_000
#: The exit status of a cell the server did not decide (as a transport error's).
EXIT_NOT_DECIDED = 3

#: Marks a cell whose chosen path has a known hazard; the hazards are listed under the table.
HAZARD_MARK = "!"

#: What a cell can say: a backend was chosen, the layer stays unquantized (vLLM builds no
#: WNA16 method for it), vLLM fails the deployment, the spec is invalid, the server failed.
OUTCOMES = ("chosen", "unquantized", "fails", "invalid", "error")

#: (spec, ruleset) -> (the JSON answer a single `select --json` prints, its exit status).
Answer = Callable[[Mapping[str, Any], str], tuple[dict[str, Any], int]]
#: (a model's deployment spec, a GPU preset name) -> the spec for that GPU, with the flags.
SpecFor = Callable[[Mapping[str, Any], str], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class MatrixModel:
    """One row's model: its label, where its config came from, and its deployment spec
    (or the answer that says why there is none: not quantized, not a MoE config)."""

    label: str
    origin: str
    spec: Mapping[str, Any] | None
    invalid: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Cell:
    model: str
    ruleset: str
    gpu: str
    outcome: str
    backend: str | None
    hazards: tuple[Mapping[str, str], ...]
    #: Why there is no backend: vLLM's error, the invalid fields, the server's error.
    problem: str | None
    exit_code: int
    #: The platform the cell was decided for (the preset, with --packages and --env).
    platform: Mapping[str, Any] | None

    @property
    def text(self) -> str:
        """What the table shows."""
        shown = {
            "chosen": self.backend or "",
            "unquantized": "unquantized",
            "fails": "FAILS",
            "invalid": "invalid",
            "error": "error",
        }[self.outcome]
        return shown + (HAZARD_MARK if self.hazards else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "ruleset": self.ruleset,
            "gpu": self.gpu,
            "outcome": self.outcome,
            "backend": self.backend,
            "hazards": [dict(h) for h in self.hazards],
            "problem": self.problem,
            "platform": None if self.platform is None else dict(self.platform),
        }


@dataclass(frozen=True, slots=True)
class Matrix:
    models: tuple[MatrixModel, ...]
    gpus: tuple[str, ...]
    rulesets: tuple[str, ...]
    cells: tuple[Cell, ...]

    @property
    def exit_code(self) -> int:
        """The worst cell's status, as `select` over several specs reports."""
        return max((cell.exit_code for cell in self.cells), default=0)

    def cell(self, model: str, ruleset: str, gpu: str) -> Cell:
        return next(c for c in self.cells if (c.model, c.ruleset, c.gpu) == (model, ruleset, gpu))


@dataclass(frozen=True, slots=True)
class MatrixQuery:
    """A matrix to decide: its rows (each model's deployment spec), GPU preset names and
    canonical ruleset names; `platform`: fields laid over every GPU's preset profile
    (`lay_over`: packages, env; empty: the presets as they are)."""

    models: Sequence[MatrixModel]
    gpus: Sequence[str]
    rulesets: Sequence[str]
    platform: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cells(self) -> int:
        return len(self.models) * len(self.gpus) * len(self.rulesets)


def lay_over(profile: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """A platform profile's JSON with `overlay`'s fields laid over it (`select --packages`
    replaces the packages, each `--env` entry is added to the profile's env)."""
    platform = {**profile, **overlay}
    if "env" in overlay:
        platform["env"] = {**(profile.get("env") or {}), **overlay["env"]}
    return platform


def size_problem(cells: int) -> str | None:
    """What is wrong with a matrix of `cells` cells (more than MAX_MATRIX_CELLS), or None."""
    if cells > MAX_MATRIX_CELLS:
        return f"{cells} cells; a matrix has at most {MAX_MATRIX_CELLS}"
    return None


def build_matrix(
    models: Sequence[MatrixModel],
    gpus: Sequence[str],
    rulesets: Sequence[str],
    *,
    spec_for: SpecFor,
    answer: Answer,
    budget: Budget | None = None,
) -> Matrix:
    """Decide every (model, ruleset, GPU) cell with `answer`. Once `budget` is spent, the
    cells not decided yet say so (outcome "error"): what was decided is kept."""
    cells: list[Cell] = []
    for model in models:
        for ruleset in rulesets:
            for gpu in gpus:
                if model.spec is None:
                    result, code, platform = dict(model.invalid or {}), 2, None
                elif budget is not None and budget.spent:
                    cells.append(not_decided(model.label, ruleset, gpu, budget.seconds))
                    continue
                else:
                    spec = spec_for(model.spec, gpu)
                    result, code = answer(spec, ruleset)
                    platform = result.get("platform") or spec.get("platform")
                    if isinstance(platform, str):  # a preset's name
                        platform = preset(platform).to_json()
                cells.append(
                    _cell(
                        model=model.label,
                        ruleset=ruleset,
                        gpu=gpu,
                        result=result,
                        code=code,
                        platform=platform,
                    )
                )
    return Matrix(tuple(models), tuple(gpus), tuple(rulesets), tuple(cells))


def not_decided(model: str, ruleset: str, gpu: str, budget_s: float) -> Cell:
    """A cell the time budget did not reach."""
    problem = (
        f"DEADLINE_EXCEEDED: not decided within the time budget of {budget_s:g} s (the "
        f"smaller of the call's deadline and the server's {BUDGET_SETTING}); ask for fewer "
        "cells at once"
    )
    return Cell(model, ruleset, gpu, "error", None, (), problem, EXIT_NOT_DECIDED, None)


def _cell(
    *,
    model: str,
    ruleset: str,
    gpu: str,
    result: Mapping[str, Any],
    code: int,
    platform: Mapping[str, Any] | None,
) -> Cell:
    error = result.get("error")
    backend = result.get("backend")
    problem: str | None = None
    if "invalid" in result:
        outcome = "invalid"
        problem = "; ".join(f"{v['field']}: {v['description']}" for v in result["invalid"])
    elif isinstance(error, Mapping):
        outcome = "error" if error.get("stage") == "server" else "fails"
        problem = f"{error.get('type')}: {error.get('message')}"
    elif backend is None:
        outcome = "unquantized"
    else:
        outcome = "chosen"
    hazards = tuple(
        {"code": str(h.get("code")), "message": str(h.get("message"))}
        for h in result.get("hazards") or []
    )
    return Cell(model, ruleset, gpu, outcome, backend, hazards, problem, code, platform)


def to_json(matrix: Matrix) -> dict[str, Any]:
    """The whole matrix as one JSON object: the axes, then every cell."""
    return {
        "gpus": list(matrix.gpus),
        "rulesets": list(matrix.rulesets),
        "models": [{"label": m.label, "origin": m.origin} for m in matrix.models],
        "cells": [cell.to_json() for cell in matrix.cells],
    }


def model_from_config(label: str, origin: str, config: Any) -> MatrixModel:
    """A row's model from a config.json object; a config the oracle cannot read (not
    quantized, not a MoE model) is a row that says why."""
    try:
        spec = deployment_from_model_config(config)
    except InvalidSpecError as exc:
        invalid = [{"field": v.field, "description": v.description} for v in exc.violations]
        return MatrixModel(label, origin, None, {"invalid": invalid})
    return MatrixModel(label, origin, spec)


def gpu_names(text: str | None) -> list[str]:
    """`--gpu`: one preset, several comma separated, or "all" (every preset). Each name is
    checked against the presets here, so a typo fails before any cell is decided."""
    if text is None:
        return []
    if text.strip().lower() == "all":
        return list(PLATFORM_PRESETS)
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        preset(name, field_name="--gpu")
    return list(dict.fromkeys(names))


def ruleset_names(text: str | None) -> list[str]:
    """`--ruleset`: one or several comma separated rulesets, each in any form the oracle's
    resolver accepts ("vllm-0.33", "0.33", "v0.33.0"), as their canonical names."""
    if text is None:
        return [DEFAULT_RULESET]
    names = [resolve_ruleset(part, field="--ruleset") for part in text.split(",") if part.strip()]
    if not names:
        raise InvalidSpecError.single("--ruleset", f"name a ruleset; known: {list(RULESETS)}")
    return list(dict.fromkeys(names))
