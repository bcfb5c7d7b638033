"""The job's journal and the state of its output directory between runs.

Each unit's file appears only complete (temp + fsync + rename) and is then recorded in the
journal (``.moe-control-journal/``, one small JSON file per unit, written atomically), so an
interrupted run, a crash or a cancellation loses at most the unit in flight. Before a run
starts, `prepare_output` checks that the directory is empty or holds this very conversion
(finished or not), and `sweep_temps` removes the temp files writers that died mid-file left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from service.formats.checkpoint.plan import JOURNAL_DIR, MANIFEST_NAME, CheckpointJob, read_json
from service.formats.errors import ConvertInputError
from service.formats.io.safetensors import atomic_write_bytes
from service.process import pid_alive

__all__ = [
    "Journal",
    "file_identity",
    "prepare_output",
    "remove_if_bare",
    "source_unit",
    "sweep_temps",
]


class Journal:
    """One JSON record per finished unit, written atomically."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / JOURNAL_DIR

    def ensure(self) -> None:
        self.path.mkdir(exist_ok=True)

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.path / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write(self, name: str, record: Mapping[str, Any]) -> None:
        """Atomic, not fsynced: a record is written only after its unit's file is durable,
        and a record lost in a power cut only means the unit is verified or redone."""
        self.ensure()
        atomic_write_bytes(
            self.path / f"{name}.json", json.dumps(record, indent=1).encode(), durable=False
        )

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def remove_if_bare(output_dir: Path, created: Path) -> bool:
    """Remove `created` (the output directory, or the first of its parents this run made)
    when the output holds nothing but the journal's bookkeeping: the job record, source
    hashes and temp files, no unit. A refused conversion then leaves no directory behind;
    one that holds a unit (this run's or a concurrent range's) is kept."""
    journal = output_dir / JOURNAL_DIR
    try:
        outside = [e.name for e in os.scandir(output_dir) if e.name != JOURNAL_DIR]
        inside = [e.name for e in os.scandir(journal)] if journal.is_dir() else []
    except FileNotFoundError:
        return False
    bookkeeping = ("job.json", SOURCE_PREFIX)
    if any(not _TEMP.match(name) for name in outside) or any(
        not (name.startswith(bookkeeping) or _TEMP.match(name)) for name in inside
    ):
        return False
    shutil.rmtree(created, ignore_errors=True)
    return True


def file_identity(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


#: How the journal records of source files' hashes begin (`source_unit`).
SOURCE_PREFIX = "source-"


def source_unit(name: str) -> str:
    """The journal record of one source file's SHA-256."""
    return SOURCE_PREFIX + name.replace("/", "%")


def prepare_output(job: CheckpointJob, output_dir: Path) -> dict[str, Any]:
    """Create the output directory, or check that what it holds is this conversion's.
    Returns the previous manifest's records by unit (empty for a fresh directory)."""
    field = "checkpoint.output_dir"
    if output_dir.exists() and not output_dir.is_dir():
        raise ConvertInputError(field, f"{output_dir} exists and is not a directory")
    job.root.check(output_dir, field)
    output_dir.mkdir(parents=True, exist_ok=True)
    key = job.key()
    manifest_path = output_dir / MANIFEST_NAME
    journal_job = output_dir / JOURNAL_DIR / "job.json"
    previous: dict[str, Any] = {}
    if manifest_path.exists():
        manifest = read_json(manifest_path, field)
        if not isinstance(manifest, dict) or manifest.get("job_key") != key:
            raise ConvertInputError(
                field,
                f"{output_dir} holds another conversion (backend "
                f"{manifest.get('backend') if isinstance(manifest, dict) else '?'}); "
                "choose an empty directory",
            )
        previous = {record["unit"]: record for record in manifest.get("units", [])}
    elif journal_job.exists():
        recorded = read_json(journal_job, field)
        if not isinstance(recorded, dict) or recorded.get("job_key") != key:
            raise ConvertInputError(
                field,
                f"{output_dir} holds an unfinished different conversion; choose an empty directory",
            )
    elif any(entry.name != JOURNAL_DIR for entry in os.scandir(output_dir)):
        raise ConvertInputError(
            field, f"{output_dir} is not empty and holds no moe-control conversion"
        )
    Journal(output_dir).write(
        "job", {"job_key": key, "backend": job.target.backend, "ruleset": job.target.ruleset}
    )
    return previous


#: The temp file of an atomic write (io/safetensors.py): `.NAME.tmp-PID-RANDOM`.
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


def sweep_temps(directory: Path, names: Iterable[str]) -> list[str]:
    """Remove what writers of `names` left when they died mid-file (kill -9, OOM, power
    loss): a temp file as large as a layer, that no rename will ever claim. Only files of
    units this run owns, and only of writers not alive here: another range's run (another
    pod, whose processes this one cannot see) never shares a unit with this one."""
    wanted = set(names)
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _TEMP.match(entry.name)
            if match is None or match["name"] not in wanted or pid_alive(int(match["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed
