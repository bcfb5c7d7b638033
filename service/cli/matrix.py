"""The fleet matrix of `moe-control select`: models by GPUs (by ruleset too), each cell the
backend vLLM picks, hazards marked: how the CLI shows it (table, CSV, JSON); the matrix
itself is built in service.dataplane.matrix.

A platform engineer with several checkpoints and a mixed fleet asks one question: which
backend does each model get on each GPU, and where does it break. The matrix asks the
oracle (or a server: the whole matrix in one SelectMatrix call) once per model, ruleset and
GPU, through the same answer function a single `select` uses, so a cell says exactly what
that single answer says.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence

from service.cli.configs import ModelConfig
from service.dataplane.matrix import (
    HAZARD_MARK,
    Matrix,
    MatrixModel,
    model_from_config,
    to_json,
)

__all__ = ["models_from_configs", "render", "render_table", "to_csv"]


def render_table(matrix: Matrix) -> str:
    """Models down, GPUs across (a RULESET column when there are several), then the notes:
    every hazard and every failure, each once per cell."""
    by_ruleset = len(matrix.rulesets) > 1
    header = ["MODEL", *(["RULESET"] if by_ruleset else []), *matrix.gpus]
    rows = [header]
    for model in matrix.models:
        for ruleset in matrix.rulesets:
            texts = [matrix.cell(model.label, ruleset, gpu).text for gpu in matrix.gpus]
            rows.append([model.label, *([ruleset] if by_ruleset else []), *texts])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    notes = _notes(matrix, by_ruleset)
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines)


def _notes(matrix: Matrix, by_ruleset: bool) -> list[str]:
    notes: list[str] = []
    invalid_models = {m.label for m in matrix.models if m.spec is None}
    for model in matrix.models:
        if model.spec is None:
            # Invalid on every GPU alike: said once.
            first = matrix.cell(model.label, matrix.rulesets[0], matrix.gpus[0])
            notes.append(f"invalid {model.label}: {first.problem}")
    for cell in matrix.cells:
        if cell.model in invalid_models:
            continue
        where = f"{cell.model} on {cell.gpu}" + (f" ({cell.ruleset})" if by_ruleset else "")
        for hazard in cell.hazards:
            notes.append(f"{HAZARD_MARK} {where}: hazard {hazard['code']}: {hazard['message']}")
        if cell.problem is not None:
            notes.append(f"{cell.text} {where}: {cell.problem}")
    return notes


CSV_COLUMNS = ("model", "origin", "ruleset", "gpu", "outcome", "backend", "hazards", "problem")


def to_csv(matrix: Matrix) -> str:
    """One row per cell (long form, for spreadsheets and dataframes); hazard codes joined
    by spaces."""
    origins = {m.label: m.origin for m in matrix.models}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for cell in matrix.cells:
        writer.writerow(
            [
                cell.model,
                origins[cell.model],
                cell.ruleset,
                cell.gpu,
                cell.outcome,
                cell.backend or "",
                " ".join(h["code"] for h in cell.hazards),
                cell.problem or "",
            ]
        )
    return buffer.getvalue()


def render(matrix: Matrix, output: str) -> str:
    """`output` is "table", "json" or "csv"."""
    if output == "json":
        return json.dumps(to_json(matrix))
    if output == "csv":
        return to_csv(matrix).rstrip("\n")
    return render_table(matrix)


def models_from_configs(configs: Sequence[ModelConfig]) -> list[MatrixModel]:
    """Each config's row (service.dataplane.matrix.model_from_config)."""
    return [model_from_config(c.label, c.origin, c.config) for c in configs]
