"""Checked-in conversion records: each vLLM release's own bytes for the exactness grid.

A release's environment is gigabytes, so CI converts only with vLLM 0.33.0 live; every other
release's conversions are recorded once (`make parity-record VLLM=X.Y.Z` records them beside
the selection answers) into `records/vllm-X.Y.conversions.jsonl.gz` and compared on every
test run with what our writers produce for that release's ruleset.

The file is gzip'd JSON Lines: a header (format, ruleset, the release's own `vllm.__version__`,
the hash of the cases — their specs and input tensors — and the command that regenerates
it), then one outcome per case in grid order: either the SHA-256 of every tensor the release
produced (its loaded layer parameters ``param.*`` and its conversion's outputs ``out.*``,
each hashed with its dtype and shape), or the exception it raised. Bytes are reproducible
(the parity records' canonical JSON and gzip settings).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.formats.exactness_cases import (
    UNINITIALISED_PARAMS,
    Case,
    holds_uninitialised_memory,
    reads_uninitialised_memory,
)
from tests.parity.records import canonical, jsonl_gz, regenerate_command, ruleset_for

RECORDS_DIR = Path(__file__).resolve().with_name("records")
SUFFIX = ".conversions.jsonl.gz"
#: Bumped when the header or line layout changes (a reader refuses other formats).
FORMAT = 1
#: How much of an exception's message is kept (whitespace collapsed): enough to tell
#: refusals apart, without the tensor reprs some messages end with.
MESSAGE_CHARS = 240


#: The digest's hash part for a tensor whose bytes are not reproducible (uninitialised memory).
UNSET = "unset"


def tensor_digest(tensor: torch.Tensor, *, with_bytes: bool = True) -> str:
    """``dtype[shape]:sha256`` of a tensor's bytes (row-major), e.g. ``uint8[2,256,64]:ab12..``;
    ``dtype[shape]:unset`` when its bytes are not to be compared."""
    shape = ",".join(str(size) for size in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    if not with_bytes:
        return f"{dtype}[{shape}]:{UNSET}"
    flat = tensor.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{dtype}[{shape}]:{hashlib.sha256(data).hexdigest()}"


def digests(tensors: dict[str, torch.Tensor], *, with_bytes: bool = True) -> dict[str, str]:
    return {name: tensor_digest(t, with_bytes=with_bytes) for name, t in sorted(tensors.items())}


def cases_hash(cases: list[Case], inputs: dict[str, dict[str, torch.Tensor]]) -> str:
    """SHA-256 over every case's spec and input tensor digests, in grid order."""
    rows = [{"id": c.id, "spec": c.spec(), "inputs": digests(inputs[c.id])} for c in cases]
    return hashlib.sha256(canonical(rows).encode("ascii")).hexdigest()


def outcome(case: Case, result: dict[str, Any], outputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One recorded line: the checker's result for a case, its tensors as digests."""
    case_id = case.id
    if not result["ok"]:
        message = " ".join(str(result["error"]).split())
        return {
            "id": case_id,
            "ok": False,
            "error_type": result["error_type"],
            "error": message[:MESSAGE_CHARS],
        }
    tensors = digests(outputs, with_bytes=not reads_uninitialised_memory(case))
    if holds_uninitialised_memory(case):
        for name in UNINITIALISED_PARAMS:
            if name in outputs:
                tensors[name] = tensor_digest(outputs[name], with_bytes=False)
    return {"id": case_id, "ok": True, "tensors": tensors, "none": result["none"]}


def record_path(ruleset: str, directory: Path = RECORDS_DIR) -> Path:
    return directory / f"{ruleset}{SUFFIX}"


@dataclass(frozen=True)
class ConversionRecord:
    """One release's recorded conversion outcomes."""

    ruleset: str
    vllm_version: str
    cases_sha256: str
    outcomes: tuple[dict[str, Any], ...]

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "ruleset": self.ruleset,
            "vllm_version": self.vllm_version,
            "cases_sha256": self.cases_sha256,
            "cases": len(self.outcomes),
            "command": regenerate_command(self.vllm_version),
        }

    def by_id(self) -> dict[str, dict[str, Any]]:
        return {line["id"]: line for line in self.outcomes}

    def stale_for(self, current_hash: str) -> str | None:
        """Why this record does not describe the current cases, or None."""
        if self.cases_sha256 == current_hash:
            return None
        return (
            f"the conversion cases changed after {self.ruleset}'s record was made "
            f"(cases {current_hash[:12]}, record {self.cases_sha256[:12]}); regenerate it "
            f"with `{regenerate_command(self.vllm_version)}`"
        )


def to_bytes(record: ConversionRecord) -> bytes:
    return jsonl_gz([record.header(), *record.outcomes])


def load(path: Path) -> ConversionRecord:
    lines = [line for line in gzip.decompress(path.read_bytes()).decode("ascii").splitlines()]
    if not lines:
        raise ValueError(f"{path.name}: empty conversion record")
    header = json.loads(lines[0])
    if header.get("format") != FORMAT:
        raise ValueError(f"{path.name}: format {header.get('format')!r}, expected {FORMAT}")
    outcomes = tuple(json.loads(line) for line in lines[1:] if line)
    if header["cases"] != len(outcomes):
        raise ValueError(f"{path.name}: header says {header['cases']} cases, has {len(outcomes)}")
    record = ConversionRecord(
        header["ruleset"], header["vllm_version"], header["cases_sha256"], outcomes
    )
    named = path.name == f"{record.ruleset}{SUFFIX}"
    if not named or ruleset_for(record.vllm_version) != record.ruleset:
        raise ValueError(f"{path.name} holds the record of vLLM {record.vllm_version}")
    return record


def recorded_rulesets(directory: Path = RECORDS_DIR) -> list[str]:
    return sorted(path.name.removesuffix(SUFFIX) for path in directory.glob(f"*{SUFFIX}"))
