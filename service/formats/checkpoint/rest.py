"""Everything of a checkpoint that is not a MoE layer, copied as it is.

Every other tensor is copied byte for byte into a shard of the input shard's name (one unit
per shard), and the small files (config, tokenizer, generation config) as they are (one
unit for all, recorded with their SHA-256s). Only the run whose layer range starts at 0
copies the rest.
"""

from __future__ import annotations

import hashlib
import time

from service.formats.checkpoint.progress import CheckFn, Progress, RunTotals
from service.formats.checkpoint.records import UnitRecords
from service.formats.checkpoint.shards import Shards
from service.formats.io.safetensors import (
    SafetensorsWriter,
    TensorPlan,
    atomic_write_bytes,
    hash_file,
)

__all__ = ["RestCopy"]


class RestCopy:
    """Copies the non-MoE tensors (shard by shard) and the small files."""

    def __init__(
        self,
        *,
        shards: Shards,
        records: UnitRecords,
        totals: RunTotals,
        report: Progress,
        check: CheckFn,
    ) -> None:
        self.job = records.job
        self.shards = shards
        self.records = records
        self.totals = totals
        self.report = report
        self.check = check

    def copy_shard(self, file: str, names: list[str]) -> None:
        """The shard's other tensors (`names`, in file order), unless their copy verifies."""
        unit = f"copy-{file}"
        shard = self.shards[file]
        bytes_in = sum(shard.entries[n].nbytes for n in names)
        self.report("verifying", file)
        record = self.records.verified(unit, [file])
        if record is not None:
            self.records.skip(unit, record)
            self.report.add(nbytes=bytes_in)
            return
        self.report("copying", file, force=True)
        began = time.perf_counter()
        plans = [
            TensorPlan(n, shard.entries[n].dtype, shard.entries[n].shape, shard.entries[n].nbytes)
            for n in names
        ]
        path = self.job.output_dir / file
        self.job.root.check(path.parent, "checkpoint.output_dir")
        with SafetensorsWriter(path, plans, shard.metadata or {"format": "pt"}) as out:
            for name in names:
                self.check()
                out.write(name, shard.raw(name))
                self.report("copying", name, nbytes=shard.entries[name].nbytes)
            out.commit()
        totals = self.totals
        with totals.lock:
            totals.bytes_in += bytes_in
            totals.bytes_out += out.data_bytes
            totals.add_stages({"copy_rest": time.perf_counter() - began})
        self.records.record(unit, "copy", file, [file], out)

    def copy_meta(self, files: list[str]) -> None:
        """Small files, copied as they are (recorded with their SHA-256)."""
        unit = "meta"
        records = self.records
        record = records.earlier(unit)
        expected = {name: records.source_identity(name) for name in files}
        if (
            record is not None
            and record.get("job_key") == records.key
            and record.get("sources") == expected
            and all(
                (self.job.output_dir / n).is_file()
                and hash_file(self.job.output_dir / n) == record["files"].get(n)
                for n in files
            )
        ):
            records.records[unit] = record
            return
        digests: dict[str, str] = {}
        for name in files:
            source = self.job.root.child(self.job.input_dir, name, f"checkpoint.input_dir/{name}")
            data = source.read_bytes()
            atomic_write_bytes(self.job.output_dir / name, data)
            digests[name] = hashlib.sha256(data).hexdigest()
        records.keep(
            unit,
            {
                "unit": unit,
                "kind": "meta",
                "job_key": records.key,
                "sources": expected,
                "files": digests,
            },
        )
