"""Whole Hugging Face checkpoints: every MoE layer into a kernel layout, the rest copied.

Input: a model directory (config.json, safetensors shards and their index, tokenizer and
other small files). Output, in another directory:

* ``moe-layer-<L>.safetensors`` per MoE layer: the kernel-layout tensors, named as vLLM's
  fused MoE module names its parameters (``model.layers.3.block_sparse_moe.experts.
  w13_qweight``...);
* every other tensor copied byte for byte into a shard of the input shard's name;
* the small files copied as they are, ``model.safetensors.index.json`` for all tensors,
  ``moe-control-manifest.json`` (`manifest`), and ``config.json`` with the quantization
  config that lets vLLM serve the converted files (`serving`).

Work is cut into units (one MoE layer, one shard's other tensors, the small files), each
recorded in a journal once its file is durable (`journal`), so an interrupted run loses at
most the unit in flight and a re-run skips every unit whose record still verifies
(`records`). With a layer range (Kubernetes Indexed Job, one range per pod) a run converts
its layers (`layers`); the range that starts at layer 0 also copies the rest (`rest`), and
whichever run finds every unit done writes the index and the manifest. `convert_checkpoint`
is the run: it plans the units, hands them to those parts in order and answers with the
run's totals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.formats.checkpoint import manifest
from service.formats.checkpoint.converter import Converter
from service.formats.checkpoint.journal import (
    Journal,
    prepare_output,
    remove_if_bare,
    sweep_temps,
)
from service.formats.checkpoint.layers import LayerConversion
from service.formats.checkpoint.plan import (
    CheckpointJob,
    MoELayerPlan,
    check_output_dir,
    find_moe_layers,
    meta_files,
    shard_names,
)
from service.formats.checkpoint.progress import CheckFn, Progress, ProgressFn, RunTotals
from service.formats.checkpoint.records import UnitRecords
from service.formats.checkpoint.rest import RestCopy
from service.formats.checkpoint.shards import Shards
from service.formats.errors import (
    ConversionUnsupported,
    ConvertInputError,
    FormatError,
)
from service.formats.registry import writer_for

__all__ = ["CheckpointResult", "convert_checkpoint"]


@dataclass
class CheckpointResult:
    output_dir: Path
    #: None when units of other ranges are still missing (nothing finalized yet).
    manifest_path: Path | None
    layers_total: int
    layers_converted: int
    layers_skipped: int
    bytes_in: int
    bytes_out: int
    seconds: float
    #: Time spent in the conversion math (reader + writer), summed over layers.
    convert_seconds: float
    tensors: list[dict[str, Any]]
    descriptor: dict[str, Any] | None
    #: Seconds per stage summed over this run's layers (see `layers.LayerConversion.convert`).
    stage_seconds: dict[str, float] = field(default_factory=dict)


def _no_check() -> None:
    return None


def convert_checkpoint(
    job: CheckpointJob,
    *,
    progress: ProgressFn | None = None,
    check: CheckFn = _no_check,
    converter: Converter | None = None,
) -> CheckpointResult:
    """Run (or resume) one whole-checkpoint conversion; see the module doc. Refused before
    anything is created when the output is inside the input or there is no writer for the
    target; refused later (a layer its writer cannot take) it removes the directories it
    made, so a refusal never leaves an output holding only its journal."""
    started = time.perf_counter()
    output_dir = job.output_dir
    check_output_dir(job.input_dir, output_dir)
    writer_for(job.target.backend)  # no writer here: refused before anything is created
    created = _first_missing(output_dir)
    try:
        return _run(job, started, progress=progress, check=check, converter=converter)
    except (ConversionUnsupported, ConvertInputError, FormatError):
        # Refused (a layer the writer cannot take, input that is not what it claims): what
        # this run created goes, unless a unit landed there.
        if created is not None:
            remove_if_bare(output_dir, created)
        raise


def _first_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist (what creating `path`
    creates), or None when `path` exists."""
    if path.exists():
        return None
    missing = path
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    return missing


def _run(
    job: CheckpointJob,
    started: float,
    *,
    progress: ProgressFn | None,
    check: CheckFn,
    converter: Converter | None,
) -> CheckpointResult:
    """The run itself: plan the units, prepare the output, convert and copy, finalize."""
    root, input_dir, output_dir = job.root, job.input_dir, job.output_dir
    shards = Shards(input_dir, root)
    try:
        names = shard_names(input_dir, root)
        layers, rest = find_moe_layers({name: list(shards[name].entries) for name in names})
        if not layers:
            raise ConvertInputError(
                "checkpoint.input_dir",
                "no MoE expert tensors found (expected block_sparse_moe.experts.N.w1/w2/w3 or "
                "mlp.experts.N.gate_proj/up_proj/down_proj)",
            )
        clashes = {layer.file for layer in layers} & set(names)
        if clashes:
            raise ConvertInputError(
                "checkpoint.input_dir", f"input shards clash with output names: {sorted(clashes)}"
            )
        metas = meta_files(input_dir, names) if job.owns_rest() else []
        previous = prepare_output(job, output_dir)
        journal = Journal(output_dir)
        journal.ensure()
        mine = [layer for layer in layers if job.wants(layer)]
        copies = sorted(rest) if job.owns_rest() else []
        owned = [layer.unit for layer in mine] + [f"copy-{file}" for file in copies]
        sweep_temps(output_dir, [layer.file for layer in mine] + copies + metas)
        sweep_temps(journal.path, [f"{unit}.json" for unit in owned])
        bytes_total = sum(
            shards[t.file].entries[t.name].nbytes for layer in mine for t in layer.tensors.values()
        ) + sum(shards[f].entries[n].nbytes for f in copies for n in rest[f])
        report = Progress(progress, len(mine), bytes_total)
        report("planning", force=True)
        totals = RunTotals()
        records = UnitRecords(job, journal=journal, previous=previous, totals=totals)
        converting = LayerConversion(
            job,
            shards=shards,
            records=records,
            totals=totals,
            report=report,
            check=check,
            converter=converter,
        )
        copying = RestCopy(
            shards=shards, records=records, totals=totals, report=report, check=check
        )
        hashes = manifest.SourceHashes(records, report=report, check=check)
        try:
            if job.hash_sources is not None:
                hashes.start(list(job.hash_sources))
            elif job.owns_rest():
                hashes.start(manifest.source_files(names, metas))
            records.verify_ahead(
                [(layer.unit, sorted(layer.files)) for layer in mine]
                + [(f"copy-{file}", [file]) for file in copies]
            )
            _convert_layers(mine, converting, check)
            for file in copies:
                check()
                copying.copy_shard(file, rest[file])
            converting.drain()
            if job.owns_rest():
                copying.copy_meta(metas)
            check()
            written = (
                manifest.finalize(records, hashes, layers, rest, names) if job.finalize else None
            )
        finally:
            converting.close()
            records.close()
            hashes.close()
        return CheckpointResult(
            output_dir=output_dir,
            manifest_path=written,
            layers_total=len(mine),
            layers_converted=totals.converted,
            layers_skipped=totals.skipped,
            bytes_in=totals.bytes_in,
            bytes_out=totals.bytes_out,
            seconds=time.perf_counter() - started,
            convert_seconds=totals.convert_seconds,
            tensors=manifest.tensor_list(records, mine, copies),
            descriptor=totals.descriptor,
            stage_seconds=totals.stage_seconds,
        )
    finally:
        shards.close()


def _convert_layers(mine: list[MoELayerPlan], converting: LayerConversion, check: CheckFn) -> None:
    """This run's layers in order, each next one's pages read ahead while one converts."""
    for number, layer in enumerate(mine):
        check()
        if number == 0:
            converting.prefetch(layer)
        if number + 1 < len(mine):
            converting.prefetch(mine[number + 1])  # read ahead while this one converts
        converting.convert(layer)
