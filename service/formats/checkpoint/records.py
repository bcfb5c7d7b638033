"""Which units of a whole-checkpoint run are done: their records, verified before a skip.

A re-run (or a run over the finished directory) checks each recorded unit (same conversion,
same source files by size and mtime, every output tensor's dtype, shape and SHA-256
recomputed) and skips it; a unit whose record does not hold is converted again. Records come
from the journal or from a previous manifest; verifying (hashing a layer's output) runs in
the background, ahead of the run, so a resume hashes its files in parallel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from service.formats.checkpoint.journal import Journal, file_identity
from service.formats.checkpoint.plan import CheckpointJob
from service.formats.checkpoint.progress import RunTotals
from service.formats.errors import ConvertInputError
from service.formats.io.safetensors import SafetensorsFile, SafetensorsWriter, hash_tensors

__all__ = ["UnitRecords"]


class UnitRecords:
    """This run's records by unit, and the checks that let a recorded unit be skipped."""

    def __init__(
        self,
        job: CheckpointJob,
        *,
        journal: Journal,
        previous: Mapping[str, dict[str, Any]],
        totals: RunTotals,
    ) -> None:
        self.job = job
        self.key = job.key()
        self.journal = journal
        #: The previous manifest's records by unit (empty for a fresh directory).
        self.previous = previous
        self.totals = totals
        #: The records of the units this run finished or skipped.
        self.records: dict[str, dict[str, Any]] = {}
        self._source_ids: dict[str, dict[str, int]] = {}
        #: Verifies finished units beside the conversion.
        self._helpers = ThreadPoolExecutor(2, thread_name_prefix="checkpoint-hash")
        self._verified: dict[str, Future[dict[str, Any] | None]] = {}

    def close(self) -> None:
        """Wait for the verifications in flight."""
        self._verified.clear()
        self._helpers.shutdown(wait=True, cancel_futures=True)

    def source_identity(self, name: str) -> dict[str, int]:
        if name not in self._source_ids:
            path = self.job.root.child(self.job.input_dir, name, f"checkpoint.input_dir/{name}")
            self._source_ids[name] = file_identity(path)
        return self._source_ids[name]

    def earlier(self, unit: str) -> dict[str, Any] | None:
        """The unit's record from the journal, else from the previous manifest."""
        return self.journal.read(unit) or self.previous.get(unit)

    def verify_ahead(self, units: list[tuple[str, list[str]]]) -> None:
        """Start verifying every unit that has a record (hashing its output) in the
        background, so a resume hashes files in parallel instead of one by one."""
        for unit, sources in units:
            if self.journal.read(unit) is not None or unit in self.previous:
                self._verified[unit] = self._helpers.submit(self.recorded, unit, sources)

    def verified(self, unit: str, sources: Iterable[str]) -> dict[str, Any] | None:
        """The unit's record if it is finished and still verifies (see `recorded`)."""
        future = self._verified.pop(unit, None)
        if future is not None:
            return future.result()
        if self.journal.read(unit) is None and unit not in self.previous:
            return None
        return self.recorded(unit, sources)

    def recorded(self, unit: str, sources: Iterable[str]) -> dict[str, Any] | None:
        """The unit's record if it is finished and its output still verifies."""
        record = self.earlier(unit)
        if record is None or record.get("job_key") != self.key:
            return None
        expected = {name: self.source_identity(name) for name in sorted(sources)}
        if record.get("sources") != expected:
            return None
        path = self.job.output_dir / record["file"]
        try:
            with SafetensorsFile(path) as file:
                layout = {
                    n: {"dtype": e.dtype, "shape": list(e.shape)} for n, e in file.entries.items()
                }
        except (OSError, ConvertInputError):
            return None
        tensors = record.get("tensors", {})
        if layout != {n: {"dtype": t["dtype"], "shape": t["shape"]} for n, t in tensors.items()}:
            return None
        if hash_tensors(path) != {n: t["sha256"] for n, t in tensors.items()}:
            return None
        return record

    def skip(self, unit: str, record: dict[str, Any]) -> None:
        """Take a verified unit's record as this run's."""
        self.records[unit] = record
        if record.get("descriptor") and self.totals.descriptor is None:
            self.totals.descriptor = record["descriptor"]
        self.journal.write(unit, record)

    def keep(self, unit: str, record: dict[str, Any]) -> None:
        """Record a finished unit (the journal first, then this run's records)."""
        self.journal.write(unit, record)
        self.records[unit] = record

    def record(
        self,
        unit: str,
        kind: str,
        file: str,
        sources: Iterable[str],
        writer: SafetensorsWriter,
        **extra: Any,
    ) -> dict[str, Any]:
        """Record a unit whose file `writer` just made durable (its tensors' SHA-256s)."""
        tensors = {
            plan.name: {
                "dtype": plan.dtype,
                "shape": list(plan.shape),
                "bytes": plan.nbytes,
                "sha256": writer.sha256[plan.name],
            }
            for plan in writer.plans
        }
        record = {
            "unit": unit,
            "kind": kind,
            "file": file,
            "job_key": self.key,
            "sources": {name: self.source_identity(name) for name in sorted(sources)},
            "tensors": tensors,
            **extra,
        }
        self.keep(unit, record)
        return record
