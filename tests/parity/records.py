"""Checked-in parity records: one release's answers to the whole grid, recorded once.

A release's environment is gigabytes and minutes to build, so CI cannot build one per
release; each release's answers are recorded once (`make parity-record VLLM=X.Y.Z`) into
`records/vllm-X.Y.jsonl.gz` and compared with that release's ruleset on every test run.

The file is gzip'd JSON Lines: a header line, then one answer per grid scenario in grid
order. The header carries the grid's hash (so a grid that changed after recording is
caught), the release's own `vllm.__version__`, the day of recording, the command that
regenerates it and, as provenance only, the hash of the harness that answered (a harness
change is caught live for the release CI runs; other releases are re-recorded by hand).
Bytes are reproducible: sorted keys, no whitespace, gzip with no name and mtime 0, and a
re-record that changes nothing keeps the original date.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORDS_DIR = Path(__file__).resolve().with_name("records")
SUFFIX = ".jsonl.gz"
#: Bumped when the header or line layout changes (a reader refuses other formats).
FORMAT = 1


def canonical(value: Any) -> str:
    """The one JSON text of `value`: sorted keys, no whitespace, ASCII only."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def grid_hash(specs: Sequence[dict[str, Any]]) -> str:
    """SHA-256 of the generated specs as one canonical JSON array."""
    return hashlib.sha256(canonical(list(specs)).encode("ascii")).hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ruleset_for(version: str) -> str:
    """The ruleset a vLLM release answers as: `0.33.0` and `0.33.1` are both `vllm-0.33`."""
    major, minor, *_ = version.lstrip("v").split(".")
    return f"vllm-{major}.{minor}"


def record_path(ruleset: str, directory: Path = RECORDS_DIR) -> Path:
    return directory / f"{ruleset}{SUFFIX}"


def regenerate_command(version: str) -> str:
    """The make command that records `version` again."""
    return f"make parity-record VLLM={version}"


@dataclass(frozen=True)
class Record:
    """One release's recorded answers and what they were recorded from."""

    ruleset: str
    vllm_version: str
    grid_sha256: str
    harness_sha256: str
    date: str
    answers: tuple[dict[str, Any], ...]

    @property
    def command(self) -> str:
        return regenerate_command(self.vllm_version)

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "ruleset": self.ruleset,
            "vllm_version": self.vllm_version,
            "grid_sha256": self.grid_sha256,
            "harness_sha256": self.harness_sha256,
            "scenarios": len(self.answers),
            "date": self.date,
            "command": self.command,
        }

    def same_answers(self, other: Record) -> bool:
        """True when the answers, the release and the grid are the same (date and harness
        aside)."""
        return (self.ruleset, self.vllm_version, self.grid_sha256, self.answers) == (
            other.ruleset,
            other.vllm_version,
            other.grid_sha256,
            other.answers,
        )

    def stale_for(self, specs: Sequence[dict[str, Any]]) -> str | None:
        """Why this record does not answer `specs` (the grid changed), or None."""
        if self.grid_sha256 == grid_hash(specs):
            return None
        return (
            f"the parity grid changed after {self.ruleset}'s record was made "
            f"(grid {grid_hash(specs)[:12]}, record {self.grid_sha256[:12]}); "
            f"regenerate it with `{self.command}`"
        )


def jsonl_gz(lines: Sequence[dict[str, Any]]) -> bytes:
    """Gzip'd canonical JSON Lines with no name and mtime 0: the same lines, the same bytes."""
    text = "".join(canonical(line) + "\n" for line in lines).encode("ascii")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as out:
        out.write(text)
    return buffer.getvalue()


def to_bytes(record: Record) -> bytes:
    """The record file's bytes: the same record always gives the same bytes."""
    return jsonl_gz([record.header(), *record.answers])


def from_bytes(data: bytes) -> Record:
    lines = [line for line in gzip.decompress(data).decode("ascii").splitlines() if line]
    if not lines:
        raise ValueError("empty parity record")
    header = json.loads(lines[0])
    if header.get("format") != FORMAT:
        raise ValueError(f"parity record format {header.get('format')!r}, expected {FORMAT}")
    answers = tuple(json.loads(line) for line in lines[1:])
    if header["scenarios"] != len(answers):
        raise ValueError(f"header says {header['scenarios']} scenarios, file has {len(answers)}")
    return Record(
        ruleset=header["ruleset"],
        vllm_version=header["vllm_version"],
        grid_sha256=header["grid_sha256"],
        harness_sha256=header["harness_sha256"],
        date=header["date"],
        answers=answers,
    )


def load(path: Path) -> Record:
    record = from_bytes(path.read_bytes())
    if path.name != f"{record.ruleset}{SUFFIX}":
        raise ValueError(f"{path.name} holds the record of {record.ruleset}")
    if ruleset_for(record.vllm_version) != record.ruleset:
        raise ValueError(f"{path.name}: vLLM {record.vllm_version} is not {record.ruleset}")
    return record


def recorded_rulesets(directory: Path = RECORDS_DIR) -> list[str]:
    """The rulesets that have a checked-in record, sorted."""
    return sorted(path.name.removesuffix(SUFFIX) for path in directory.glob(f"*{SUFFIX}"))
