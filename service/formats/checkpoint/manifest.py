"""The end of a whole-checkpoint job: source hashes, the index and the manifest.

``moe-control-manifest.json`` records the source files' SHA-256s, ruleset, backend, the
target layout, every output tensor's SHA-256 and the layer list; then ``config.json`` is
written with the ``quantization_config`` that tells vLLM what the files are and holds the
manifest's SHA-256 (`serving`). The config is the last file written, so the directory is
servable only once it is whole. Whichever run finds every unit done (its own, or
another range's from the journal) writes ``model.safetensors.index.json`` and the manifest,
unless told not to: a server spreading one job over its GPU workers lets only its final call
finalize (service/dataplane/spread.py).

Hashing a source file is one sequential stream at one core's speed, so a large checkpoint
hashed on one thread would outlast its conversion: `SourceHashes` hashes them in the
background, one thread per file, and reuses any hash an earlier run recorded for a file
whose size and mtime are unchanged.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from service import __version__
from service.formats.checkpoint import serving
from service.formats.checkpoint.journal import file_identity, source_unit
from service.formats.checkpoint.plan import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    MANIFEST_NAME,
    MoELayerPlan,
    read_json,
)
from service.formats.checkpoint.progress import CheckFn, Progress
from service.formats.checkpoint.records import UnitRecords
from service.formats.errors import ConvertInputError
from service.formats.io.safetensors import atomic_write_bytes, hash_file

__all__ = ["SOURCE_HASH_THREADS", "SourceHashes", "finalize", "source_files", "tensor_list"]

#: Source files hashed at once by one run (each hash is one thread, reading at its speed).
SOURCE_HASH_THREADS = 4


def source_files(shards: list[str], meta: list[str]) -> list[str]:
    """Every source file the manifest records a SHA-256 of."""
    return [*shards, *meta, "config.json", INDEX_NAME]


class SourceHashes:
    """The source files' SHA-256s for the manifest, computed beside the conversion."""

    def __init__(self, records: UnitRecords, *, report: Progress, check: CheckFn) -> None:
        self.records = records
        self.job = records.job
        self.report = report
        self.check = check
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sources")
        self._started: Future[list[dict[str, Any]]] | None = None

    def close(self) -> None:
        self._hashing.shutdown(wait=True, cancel_futures=True)

    def start(self, names: list[str]) -> None:
        """Start hashing `names` (this run's share) in the background."""
        self._started = self._hashing.submit(self.hashes, names, SOURCE_HASH_THREADS)

    def wait(self) -> None:
        """Wait for this run's share (in the journal then), re-raising its error."""
        if self._started is not None:
            self._started.result()

    def hashes(self, names: list[str], workers: int = 2) -> list[dict[str, Any]]:
        """SHA-256 of every source file, reusing a hash recorded by an earlier run (the
        previous manifest, or this conversion's journal) when the file's size and mtime are
        unchanged: re-reading a 100 GB checkpoint is not a resume."""
        job, journal, totals = self.job, self.records.journal, self.records.totals
        known: dict[str, dict[str, Any]] = {}
        manifest = job.output_dir / MANIFEST_NAME
        if manifest.exists():
            with contextlib.suppress(ConvertInputError, KeyError, TypeError, AttributeError):
                old = read_json(manifest, "checkpoint.output_dir")
                known = {f["name"]: f for f in old["source"]["files"]}
        wanted = sorted({n for n in names if (job.input_dir / n).exists()})

        def one(name: str) -> dict[str, Any]:
            self.check()
            path = job.root.child(job.input_dir, name, f"checkpoint.input_dir/{name}")
            identity = file_identity(path)
            for old in (journal.read(source_unit(name)), known.get(name)):
                if (
                    old
                    and old.get("name") == name
                    and all(old.get(k) == v for k, v in identity.items())
                ):
                    return dict(old)
            self.report("hashing", name, force=True)
            began = time.perf_counter()
            entry = {"name": name, **identity, "sha256": hash_file(path)}
            # One record per file: the ranges of a spread hash different files at once.
            journal.write(source_unit(name), entry)
            with totals.lock:
                totals.add_stages({"hash_sources": time.perf_counter() - began})
            return entry

        if not wanted:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(wanted)))) as pool:
            return list(pool.map(one, wanted))


def _all_records(
    records: UnitRecords, layers: list[MoELayerPlan], rest: Mapping[str, list[str]]
) -> dict[str, dict[str, Any]] | None:
    """Every unit's record (ours, or another range's from the journal); None if any is
    missing."""
    units = [layer.unit for layer in layers] + [f"copy-{file}" for file in sorted(rest)]
    out: dict[str, dict[str, Any]] = {}
    for unit in [*units, "meta"]:
        record = records.records.get(unit) or records.journal.read(unit)
        if record is None or record.get("job_key") != records.key:
            return None
        out[unit] = record
    return out


def finalize(
    records: UnitRecords,
    hashes: SourceHashes,
    layers: list[MoELayerPlan],
    rest: Mapping[str, list[str]],
    shards: list[str],
) -> Path | None:
    """Write the index and the manifest if every unit is done (then the journal goes);
    the manifest's path, or None while units of other ranges are still missing."""
    found = _all_records(records, layers, rest)
    if found is None:
        return None
    meta = sorted(found["meta"].get("files", {}))
    hashes.wait()
    # The files no range hashed (in a spread: the small ones) before the last stage.
    sources = hashes.hashes(source_files(shards, meta), SOURCE_HASH_THREADS)
    hashes.report("finalizing", MANIFEST_NAME, force=True)
    descriptor = records.totals.descriptor or next(
        (r["descriptor"] for r in found.values() if r.get("descriptor")), None
    )
    weight_map: dict[str, str] = {}
    total = 0
    for record in found.values():
        for name, tensor in record.get("tensors", {}).items():
            weight_map[name] = record["file"]
            total += int(tensor["bytes"])
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    job = records.job
    out = job.output_dir
    atomic_write_bytes(out / INDEX_NAME, json.dumps(index, indent=2).encode())
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"moe-control {__version__}",
        "job_key": records.key,
        "ruleset": job.target.ruleset,
        "backend": job.target.backend,
        "experts_class": job.target.experts_class,
        "chosen_by": job.target.chosen_by,
        "platform": dict(job.platform) if job.platform else None,
        "source": {
            **job.source.to_json(),
            "quantization_config": dict(job.quantization_config),
            "files": sources,
        },
        "target_format": descriptor,
        "layers": [
            {
                "index": layer.index,
                "module": layer.module,
                "file": layer.file,
                "num_experts": found[layer.unit].get("num_experts"),
            }
            for layer in layers
        ],
        "total_size": total,
        "units": list(found.values()),
    }
    atomic_write_bytes(out / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
    serving.write_model_config(job, out / MANIFEST_NAME, found.values())
    records.journal.remove()
    return out / MANIFEST_NAME


def tensor_list(
    records: UnitRecords, layers: list[MoELayerPlan], copies: list[str]
) -> list[dict[str, Any]]:
    """This run's output tensors (name, dtype, shape, bytes, SHA-256), unit by unit."""
    units = [layer.unit for layer in layers] + [f"copy-{file}" for file in copies]
    return [
        {"name": name, **tensor}
        for unit in units
        if unit in records.records
        for name, tensor in records.records[unit]["tensors"].items()
    ]
