"""Whole Hugging Face checkpoints: every MoE layer into a kernel layout, the rest copied.

Input: a model directory (config.json, safetensors shards and their index, tokenizer and
other small files). Output, in another directory:

* ``moe-layer-<L>.safetensors`` per MoE layer: the kernel-layout tensors, named as vLLM's
  fused MoE module names its parameters (``model.layers.3.block_sparse_moe.experts.
  w13_qweight``...);
* every other tensor copied byte for byte into a shard of the input shard's name;
* the small files copied as they are, ``model.safetensors.index.json`` for all tensors, and
  ``moe-control-manifest.json``: source file SHA-256s, ruleset, backend, the target layout,
  every output tensor's SHA-256, the layer list.

Work is cut into units (one MoE layer, one shard's other tensors, the small files). Each
unit's file appears only complete (temp + fsync + rename) and is then recorded in a journal
(``.moe-control-journal/``, one small JSON file per unit, also written atomically), so an
interrupted run, a crash or a cancellation loses at most the unit in flight. A re-run (or a
run over the finished directory) checks each recorded unit (same conversion, same source
files, every output tensor's SHA-256 recomputed) and skips it. With a layer range
(Kubernetes Indexed Job, one range per pod) a run converts its layers; the range that starts
at layer 0 also copies the rest, and whichever run finds every unit done writes the index
and the manifest (unless told not to: a server spreading one job over its GPU workers lets
only its final call finalize, dataplane/spread.py). The manifest is written last: its
presence means the directory is whole. Each layer's progress event carries its stage times.

This module imports torch only to convert (`convert_checkpoint`); `read_model_config` and
`find_moe_layers` are safe in the server process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service import __version__
from service.formats.input_errors import ConvertInputError
from service.formats.naming import EXPERT_INDEX, match_expert_tensor
from service.formats.paths import DataRoot
from service.formats.plan import SourceSpec, Target, resolve_target, source_spec
from service.formats.safetensors_io import (
    SafetensorsFile,
    SafetensorsWriter,
    TensorPlan,
    atomic_write_bytes,
    hash_file,
    hash_tensors,
    plan_of,
    tensor_bytes,
)
from service.oracle import PlatformProfile, deployment_from_model_config, parse_deployment

if TYPE_CHECKING:
    import torch

MANIFEST_NAME = "moe-control-manifest.json"
INDEX_NAME = "model.safetensors.index.json"
JOURNAL_DIR = ".moe-control-journal"
FORMAT = "moe-control-checkpoint"
FORMAT_VERSION = 1

ProgressFn = Callable[[dict[str, Any]], None]
CheckFn = Callable[[], None]


# ---------------------------------------------------------------------------------------
# Reading the model directory (torch-free)


def _read_json(path: Path, field: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConvertInputError(field, f"{path.name} not found in {path.parent}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertInputError(field, f"cannot read {path.name}: {exc}") from None


def read_model_config(input_dir: Path, root: DataRoot, field: str = "checkpoint.input_dir") -> Any:
    """The model's config.json object (confined to the root like every other file)."""
    if not input_dir.is_dir():
        raise ConvertInputError(field, f"{input_dir} is not a directory")
    config = _read_json(root.child(input_dir, "config.json", field), field)
    if not isinstance(config, dict):
        raise ConvertInputError(field, "config.json does not hold a JSON object")
    return config


def shard_names(input_dir: Path, root: DataRoot, field: str = "checkpoint.input_dir") -> list[str]:
    """The safetensors shards: the index's, else the lone model.safetensors, else every
    *.safetensors in the directory."""
    index = input_dir / INDEX_NAME
    if index.exists():
        data = _read_json(root.child(input_dir, INDEX_NAME, field), field)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ConvertInputError(field, f"{INDEX_NAME} has no weight_map of file names")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in input_dir.glob("*.safetensors"))
    if not names:
        raise ConvertInputError(field, f"no safetensors files in {input_dir}")
    for name in names:
        path = root.child(input_dir, name, f"{field}/{name}")
        if not path.is_file():
            raise ConvertInputError(f"{field}/{name}", "listed in the index but missing")
    return names


@dataclass(frozen=True, slots=True)
class SourceTensor:
    file: str
    name: str


@dataclass
class MoELayerPlan:
    """One MoE layer of the checkpoint: its module and its per-expert tensors."""

    index: int
    module: str
    family: str
    #: name relative to the experts module ("0.w1.qweight") -> where it is.
    tensors: dict[str, SourceTensor] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return f"moe-layer-{self.index:05d}"

    @property
    def file(self) -> str:
        return f"{self.unit}.safetensors"

    @property
    def num_experts(self) -> int:
        found = {int(m[1]) for key in self.tensors if (m := EXPERT_INDEX.match(key))}
        return max(found) + 1 if found else 0

    @property
    def files(self) -> set[str]:
        return {t.file for t in self.tensors.values()}


def find_moe_layers(
    names_by_file: Mapping[str, Iterable[str]],
) -> tuple[list[MoELayerPlan], dict[str, list[str]]]:
    """Split a checkpoint's tensor names into MoE layers (sorted by layer index) and, per
    file, the other tensors (kept in file order)."""
    layers: dict[str, MoELayerPlan] = {}
    rest: dict[str, list[str]] = {}
    for file, names in names_by_file.items():
        for name in names:
            hit = match_expert_tensor(name)
            if hit is None:
                rest.setdefault(file, []).append(name)
                continue
            family, module, index, key = hit
            layer = layers.setdefault(module, MoELayerPlan(index, module, family))
            layer.tensors[key] = SourceTensor(file, name)
    ordered = sorted(layers.values(), key=lambda layer: (layer.index, layer.module))
    indices = [layer.index for layer in ordered]
    if len(set(indices)) != len(indices):
        raise ConvertInputError(
            "checkpoint.input_dir", "two MoE expert modules share one decoder layer index"
        )
    return ordered, rest


# ---------------------------------------------------------------------------------------
# The job


def plan_job(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    root: DataRoot,
    platform: PlatformProfile,
    backend: str = "",
    ruleset: str = "",
    layers: tuple[int, int] | None = None,
    device: str = "cpu",
    deployment: Mapping[str, Any] | None = None,
) -> CheckpointJob:
    """Resolve a request into a job: paths confined to `root`, the deployment read from the
    model's config.json (or given), the source layout from its quantization config, the
    backend as requested or as the oracle picks it for `platform`. Torch-free: the server
    runs this before handing the job to a worker."""
    source_dir = root.resolve(input_dir, "checkpoint.input_dir")
    target_dir = root.resolve(output_dir, "checkpoint.output_dir")
    if deployment is None:
        deployment = deployment_from_model_config(read_model_config(source_dir, root))
    spec = parse_deployment({**deployment, "platform": None}, default_platform=platform)
    source = source_spec(spec.hf_quantization_config, quantization=spec.quantization)
    target = resolve_target(spec, backend, ruleset=ruleset)
    if layers is not None and not 0 <= layers[0] < layers[1]:
        raise ConvertInputError("checkpoint.layers", f"empty or reversed range {list(layers)}")
    return CheckpointJob(
        input_dir=source_dir,
        output_dir=target_dir,
        root=root,
        source=source,
        target=target,
        quantization_config=dict(spec.hf_quantization_config),
        gated=spec.layer.is_gated,
        num_experts=spec.layer.num_experts,
        layers=layers,
        device=device,
        platform=spec.platform.to_json(),
    )


@dataclass(frozen=True)
class CheckpointJob:
    """A resolved whole-checkpoint conversion (paths already confined to `root`)."""

    input_dir: Path
    output_dir: Path
    root: DataRoot
    source: SourceSpec
    target: Target
    quantization_config: Mapping[str, Any]
    gated: bool = True
    num_experts: int | None = None
    #: Half-open [start, end) of decoder layer indices to convert; None: all.
    layers: tuple[int, int] | None = None
    #: Where the conversion math runs ("cpu", "cuda:0").
    device: str = "cpu"
    #: The platform profile the backend was chosen for (recorded in the manifest).
    platform: Mapping[str, Any] | None = None
    #: Whether this run writes the index and manifest when it finds every unit done. A
    #: server spreading one job over its workers runs the ranges without and one final
    #: call with it, so exactly one run finalizes however the ranges' ends interleave.
    finalize: bool = True
    #: Source files whose SHA-256 this run computes for the manifest (in the background,
    #: one thread per file); None: every file when the run owns the rest, else none. A
    #: spread hands them out over its ranges; the finalizing run hashes what is missing.
    hash_sources: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """The job as the worker protocol carries it (paths already resolved)."""
        return {
            "input_dir": str(self.input_dir),
            "output_dir": str(self.output_dir),
            "root": str(self.root.root),
            "source": self.source.to_json(),
            "target": self.target.to_json(),
            "quantization_config": dict(self.quantization_config),
            "gated": self.gated,
            "num_experts": self.num_experts,
            "layers": list(self.layers) if self.layers is not None else None,
            "device": self.device,
            "platform": dict(self.platform) if self.platform else None,
            "finalize": self.finalize,
            "hash_sources": list(self.hash_sources) if self.hash_sources is not None else None,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CheckpointJob:
        target = obj["target"]
        layers = obj.get("layers")
        hashed = obj.get("hash_sources")
        return cls(
            input_dir=Path(obj["input_dir"]),
            output_dir=Path(obj["output_dir"]),
            root=DataRoot(Path(obj["root"])),
            source=SourceSpec.from_json(obj["source"]),
            target=Target(
                str(target["backend"]),
                str(target.get("experts_class", "")),
                str(target["ruleset"]),
                str(target.get("chosen_by", "request")),
            ),
            quantization_config=dict(obj.get("quantization_config") or {}),
            gated=bool(obj.get("gated", True)),
            num_experts=obj.get("num_experts"),
            layers=(int(layers[0]), int(layers[1])) if layers else None,
            device=str(obj.get("device", "cpu")),
            platform=obj.get("platform"),
            finalize=bool(obj.get("finalize", True)),
            hash_sources=tuple(str(n) for n in hashed) if hashed is not None else None,
        )

    def key(self) -> str:
        """Identity of the conversion (not of the run): a journal or manifest with another
        key belongs to a different conversion and is never resumed."""
        identity = {
            "format_version": FORMAT_VERSION,
            "source": self.source.to_json(),
            "backend": self.target.backend,
            "ruleset": self.target.ruleset,
            "gated": self.gated,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def owns_rest(self) -> bool:
        """Whether this run copies the non-MoE tensors and small files."""
        return self.layers is None or self.layers[0] == 0

    def wants(self, layer: MoELayerPlan) -> bool:
        return self.layers is None or self.layers[0] <= layer.index < self.layers[1]


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
    #: Seconds per stage summed over this run's layers (see `_Run.moe_layer`).
    stage_seconds: dict[str, float] = field(default_factory=dict)


Converter = Callable[[MoELayerPlan, Mapping[str, "torch.Tensor"]], tuple[dict[str, Any], Any]]


def registry_converter(
    job: CheckpointJob, *, direct_routes: bool = True, stages: dict[str, float] | None = None
) -> Converter:
    """Per-expert tensors of one layer -> (kernel tensors on the CPU, descriptor JSON):
    a direct packed -> packed route where `direct.ROUTES` has one for the layer, else the
    format registry (reader -> canonical -> writer); the same bytes either way. Without
    `direct_routes` always the canonical route (the bench's before/after). With `stages`,
    each call adds its seconds per stage there (`to_device`: the mapped shard pages read
    and copied to the GPU; `repack`; `to_host`), the device synchronized between stages
    so each stage's time is its own: where a layer's time goes is what a slow conversion
    needs to show first."""
    import torch

    from service.formats import direct, registry

    quant = registry.SourceQuantization(
        bits=job.source.bits,
        group_size=job.source.group_size,
        symmetric=job.source.symmetric,
        desc_act=job.source.desc_act,
        gptq_v2=job.source.gptq_v2,
    )
    registry.writer_for(job.target.backend)  # ConversionUnsupported before any work
    device = torch.device(job.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def lap(stage: str, since: float) -> float:
        now = time.perf_counter()
        if stages is not None:
            sync()
            now = time.perf_counter()
            stages[stage] = stages.get(stage, 0.0) + now - since
        return now

    def convert(
        layer: MoELayerPlan, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Any], Any]:
        began = time.perf_counter()
        if device.type != "cpu":
            tensors = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
            began = lap("to_device", began)
        route = direct.convert if direct_routes else direct.canonical
        converted = route(
            job.source.layout,
            tensors,
            quant,
            job.target.backend,
            num_experts=job.num_experts or layer.num_experts,
            gated=job.gated,
        )
        began = lap("repack", began)
        out = {k: _to_host(v) for k, v in converted.tensors.items()}
        sync()
        if device.type != "cpu":
            lap("to_host", began)
        return out, descriptor_json(converted.descriptor)

    return convert


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into pinned host memory (the caller synchronizes). A copy
    into fresh pageable memory goes through the driver's staging buffer and first-touch
    page faults (about 4 GB/s); pinned blocks come from torch's caching host allocator,
    reused layer after layer, and the copy runs at the link's speed. The bytes are the
    same: the copy is contiguous in the tensor's logical order, as `tensor_bytes` reads."""
    import torch

    if tensor.device.type == "cpu":
        return tensor
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    host = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def descriptor_json(descriptor: Any) -> dict[str, Any]:
    """A writer's TargetDescriptor as JSON (plain fields; mappings as dicts)."""
    out: dict[str, Any] = {}
    for name in getattr(descriptor, "__dataclass_fields__", {}):
        value = getattr(descriptor, name)
        out[name] = dict(value) if isinstance(value, Mapping) else value
    return out


class _Shards:
    """The input shards, each mapped once for the whole run."""

    def __init__(self, directory: Path, root: DataRoot) -> None:
        self.directory = directory
        self.root = root
        self._open: dict[str, SafetensorsFile] = {}

    def __getitem__(self, name: str) -> SafetensorsFile:
        file = self._open.get(name)
        if file is None:
            field = f"checkpoint.input_dir/{name}"
            file = SafetensorsFile(self.root.child(self.directory, name, field), field)
            self._open[name] = file
        return file

    def close(self) -> None:
        for file in self._open.values():
            file.close()
        self._open.clear()


class _Progress:
    """Progress events, at most every `interval` seconds unless forced.

    A count and the event that reports it are one step under one lock (`__call__` with
    `layers`/`nbytes`), and events leave in the order their counts were taken: two layers
    written at once by two threads report 1/2 then 2/2, never 2/2 twice, and a consumer
    sees the counts only ever grow."""

    def __init__(self, emit: ProgressFn | None, layers_total: int, bytes_total: int) -> None:
        self.emit = emit
        self.layers_total = layers_total
        self.bytes_total = bytes_total
        self.layers_done = 0
        self.bytes_done = 0
        self._last = 0.0
        self._lock = threading.Lock()

    def add(self, *, layers: int = 0, nbytes: int = 0) -> None:
        """Count without reporting (the next event carries it)."""
        with self._lock:
            self.layers_done += layers
            self.bytes_done += nbytes

    def __call__(
        self,
        stage: str,
        current: str = "",
        *,
        force: bool = False,
        extra: Mapping[str, Any] | None = None,
        layers: int = 0,
        nbytes: int = 0,
    ) -> None:
        """Count `layers` and `nbytes` done, then emit an event (unless throttled) with the
        counts as this call left them. The emit runs under the lock: the callbacks only
        print or queue, and holding it is what keeps the events in count order."""
        with self._lock:
            self.layers_done += layers
            self.bytes_done += nbytes
            if self.emit is None:
                return
            now = time.monotonic()
            if not force and now - self._last < 0.1:
                return
            self._last = now
            self.emit(
                {
                    "stage": stage,
                    "layers_done": self.layers_done,
                    "layers_total": self.layers_total,
                    "bytes_done": min(self.bytes_done, self.bytes_total),
                    "bytes_total": self.bytes_total,
                    "current": current,
                    **(extra or {}),
                }
            )


def _no_check() -> None:
    return None


def _file_identity(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class _Journal:
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


def convert_checkpoint(
    job: CheckpointJob,
    *,
    progress: ProgressFn | None = None,
    check: CheckFn = _no_check,
    converter: Converter | None = None,
) -> CheckpointResult:
    """Run (or resume) one whole-checkpoint conversion; see the module doc."""
    started = time.perf_counter()
    root, input_dir, output_dir = job.root, job.input_dir, job.output_dir
    if output_dir == input_dir:
        raise ConvertInputError("checkpoint.output_dir", "must differ from the input directory")
    shards = _Shards(input_dir, root)
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
        previous = _prepare_output(job, output_dir)
        journal = _Journal(output_dir)
        journal.ensure()
        mine = [layer for layer in layers if job.wants(layer)]
        copies = sorted(rest) if job.owns_rest() else []
        owned = [layer.unit for layer in mine] + [f"copy-{file}" for file in copies]
        _sweep_temps(output_dir, [layer.file for layer in mine] + copies + metas)
        _sweep_temps(journal.path, [f"{unit}.json" for unit in owned])
        bytes_total = sum(
            shards[t.file].entries[t.name].nbytes for layer in mine for t in layer.tensors.values()
        ) + sum(shards[f].entries[n].nbytes for f in copies for n in rest[f])
        report = _Progress(progress, len(mine), bytes_total)
        report("planning", force=True)
        run = _Run(
            job,
            shards=shards,
            journal=journal,
            previous=previous,
            report=report,
            check=check,
            converter=converter,
        )
        try:
            if job.hash_sources is not None:
                run.hash_sources(list(job.hash_sources))
            elif job.owns_rest():
                run.hash_sources(source_files(names, metas))
            run.verify_ahead(
                [(layer.unit, sorted(layer.files)) for layer in mine]
                + [(f"copy-{file}", [file]) for file in copies]
            )
            for number, layer in enumerate(mine):
                check()
                if number == 0:
                    run.prefetch(layer)
                if number + 1 < len(mine):
                    run.prefetch(mine[number + 1])  # read ahead while this one converts
                run.moe_layer(layer)
            for file in copies:
                check()
                run.copy_shard(file, rest[file])
            run.drain()
            if job.owns_rest():
                run.copy_meta(metas)
            check()
            manifest = run.finalize(layers, rest, names) if job.finalize else None
        finally:
            run.close()
        return CheckpointResult(
            output_dir=output_dir,
            manifest_path=manifest,
            layers_total=len(mine),
            layers_converted=run.converted,
            layers_skipped=run.skipped,
            bytes_in=run.bytes_in,
            bytes_out=run.bytes_out,
            seconds=time.perf_counter() - started,
            convert_seconds=run.convert_seconds,
            tensors=run.tensor_list(mine, copies),
            descriptor=run.descriptor,
            stage_seconds=run.stage_seconds,
        )
    finally:
        shards.close()


def source_files(shards: list[str], meta: list[str]) -> list[str]:
    """Every source file the manifest records a SHA-256 of."""
    return [*shards, *meta, "config.json", INDEX_NAME]


def meta_files(input_dir: Path, shards: list[str]) -> list[str]:
    """Small top-level files to copy unchanged (config, tokenizer, generation config)."""
    skip = {*shards, INDEX_NAME, MANIFEST_NAME}
    return sorted(
        entry.name
        for entry in os.scandir(input_dir)
        if entry.is_file()
        and entry.name not in skip
        and not entry.name.startswith(".")
        and not entry.name.endswith(".safetensors")
    )


def _prepare_output(job: CheckpointJob, output_dir: Path) -> dict[str, Any]:
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
        manifest = _read_json(manifest_path, field)
        if not isinstance(manifest, dict) or manifest.get("job_key") != key:
            raise ConvertInputError(
                field,
                f"{output_dir} holds another conversion (backend "
                f"{manifest.get('backend') if isinstance(manifest, dict) else '?'}); "
                "choose an empty directory",
            )
        previous = {record["unit"]: record for record in manifest.get("units", [])}
    elif journal_job.exists():
        recorded = _read_json(journal_job, field)
        if not isinstance(recorded, dict) or recorded.get("job_key") != key:
            raise ConvertInputError(
                field,
                f"{output_dir} holds an unfinished different conversion; choose an empty directory",
            )
    elif any(entry.name != JOURNAL_DIR for entry in os.scandir(output_dir)):
        raise ConvertInputError(
            field, f"{output_dir} is not empty and holds no moe-control conversion"
        )
    _Journal(output_dir).write(
        "job", {"job_key": key, "backend": job.target.backend, "ruleset": job.target.ruleset}
    )
    return previous


#: The temp file of an atomic write (safetensors_io): `.NAME.tmp-PID-RANDOM`.
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


def _sweep_temps(directory: Path, names: Iterable[str]) -> list[str]:
    """Remove what writers of `names` left when they died mid-file (kill -9, OOM, power
    loss): a temp file as large as a layer, that no rename will ever claim. Only files of
    units this run owns, and only of writers not alive here: another range's run (another
    pod, whose processes this one cannot see) never shares a unit with this one."""
    wanted = set(names)
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _TEMP.match(entry.name)
            if match is None or match["name"] not in wanted or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: Converted layers written at once by one run, each file by its own thread: writing is
#: mostly SHA-256 of the output (one stream per tensor, at one core's speed), so one writer
#: falls behind a GPU that converts a 0.73 GB layer in milliseconds; each waiting layer
#: holds its converted tensors in host memory.
WRITES_IN_FLIGHT = 2
#: Source files hashed at once by one run (each hash is one thread, reading at its speed).
SOURCE_HASH_THREADS = 4


def _source_unit(name: str) -> str:
    """The journal record of one source file's SHA-256."""
    return "source-" + name.replace("/", "%")


class _Run:
    """State of one run over the units."""

    def __init__(
        self,
        job: CheckpointJob,
        *,
        shards: _Shards,
        journal: _Journal,
        previous: dict[str, Any],
        report: _Progress,
        check: CheckFn,
        converter: Converter | None,
    ) -> None:
        self.job = job
        self.key = job.key()
        self.shards = shards
        self.journal = journal
        self.previous = previous
        self.report = report
        self.check = check
        self._converter = converter
        self.converted = self.skipped = 0
        self.bytes_in = self.bytes_out = 0
        self.convert_seconds = 0.0
        #: Seconds per stage over the run's layers; the converter adds its own stages to
        #: `_layer_stages`, which `moe_layer` hands on with each layer.
        self.stage_seconds: dict[str, float] = {}
        self._layer_stages: dict[str, float] = {}
        self.descriptor: dict[str, Any] | None = None
        self.records: dict[str, dict[str, Any]] = {}
        self._source_ids: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        #: Writes converted layers while the next is converted (bounded: WRITES_IN_FLIGHT).
        self._writer = ThreadPoolExecutor(WRITES_IN_FLIGHT, thread_name_prefix="checkpoint-write")
        self._pending: deque[Future[None]] = deque()
        #: Verifies finished units and hashes the source files, beside the conversion.
        self._helpers = ThreadPoolExecutor(2, thread_name_prefix="checkpoint-hash")
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sources")
        self._verified: dict[str, Future[dict[str, Any] | None]] = {}
        self._sources: Future[list[dict[str, Any]]] | None = None

    def close(self) -> None:
        """Wait for the background work (an aborted write removes its temp file first)."""
        self._verified.clear()
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._helpers.shutdown(wait=True, cancel_futures=True)
        self._hashing.shutdown(wait=True, cancel_futures=True)

    def verify_ahead(self, units: list[tuple[str, list[str]]]) -> None:
        """Start verifying every unit that has a record (hashing its output) in the
        background, so a resume hashes files in parallel instead of one by one."""
        for unit, sources in units:
            if self.journal.read(unit) is not None or unit in self.previous:
                self._verified[unit] = self._helpers.submit(self.recorded, unit, sources)

    def verified(self, unit: str, sources: Iterable[str]) -> dict[str, Any] | None:
        future = self._verified.pop(unit, None)
        if future is not None:
            return future.result()
        if self.journal.read(unit) is None and unit not in self.previous:
            return None
        return self.recorded(unit, sources)

    def hash_sources(self, names: list[str]) -> None:
        """Start hashing the source files for the manifest (reusing unchanged hashes), one
        thread per file up to SOURCE_HASH_THREADS: a file's SHA-256 is one sequential
        stream, at 0.6 to 2 GB/s a core, so a 100 GB checkpoint hashed on one thread
        outlasts its conversion (bench/RESULTS.md, multi-GPU)."""
        self._sources = self._hashing.submit(self._source_hashes, names, SOURCE_HASH_THREADS)

    def prefetch(self, layer: MoELayerPlan) -> None:
        by_file: dict[str, list[str]] = {}
        for source in layer.tensors.values():
            by_file.setdefault(source.file, []).append(source.name)
        for file, names in by_file.items():
            self.shards[file].prefetch(names)

    def drain(self) -> None:
        """Wait for the layers being written (re-raising a write's error)."""
        self._wait_writes(0)

    def _wait_writes(self, most: int) -> None:
        """Wait until at most `most` layers are being written (re-raising a write's error)."""
        while len(self._pending) > most:
            self._pending.popleft().result()

    @property
    def converter(self) -> Converter:
        if self._converter is None:
            self._converter = registry_converter(self.job, stages=self._layer_stages)
        return self._converter

    def source_identity(self, name: str) -> dict[str, int]:
        if name not in self._source_ids:
            path = self.job.root.child(self.job.input_dir, name, f"checkpoint.input_dir/{name}")
            self._source_ids[name] = _file_identity(path)
        return self._source_ids[name]

    # -- resume

    def recorded(self, unit: str, sources: Iterable[str]) -> dict[str, Any] | None:
        """The unit's record if it is finished and its output still verifies."""
        record = self.journal.read(unit) or self.previous.get(unit)
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

    def _skip(self, unit: str, record: dict[str, Any]) -> None:
        self.records[unit] = record
        if record.get("descriptor") and self.descriptor is None:
            self.descriptor = record["descriptor"]
        self.journal.write(unit, record)

    def _record(
        self,
        unit: str,
        kind: str,
        file: str,
        sources: Iterable[str],
        writer: SafetensorsWriter,
        **extra: Any,
    ) -> dict[str, Any]:
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
        self.journal.write(unit, record)
        self.records[unit] = record
        return record

    # -- units

    def moe_layer(self, layer: MoELayerPlan) -> None:
        bytes_in = sum(self.shards[t.file].entries[t.name].nbytes for t in layer.tensors.values())
        self.report("verifying", layer.file)
        began = time.perf_counter()
        record = self.verified(layer.unit, layer.files)
        verify = time.perf_counter() - began
        if record is not None:
            with self._lock:
                self.skipped += 1
                self._add_stages({"verify": verify})
            self._skip(layer.unit, record)
            self.report("skipped", layer.file, force=True, layers=1, nbytes=bytes_in)
            return
        self.report("converting", layer.module, force=True)
        sources = {key: self.shards[t.file].tensor(t.name) for key, t in layer.tensors.items()}
        converter = self.converter
        self._layer_stages.clear()
        began = time.perf_counter()
        tensors, descriptor = converter(layer, sources)
        seconds = time.perf_counter() - began
        self.convert_seconds += seconds
        stages = {"verify": verify, **self._layer_stages, "convert": seconds}
        del sources
        self.check()
        began = time.perf_counter()
        self._wait_writes(WRITES_IN_FLIGHT - 1)
        stages["wait_write"] = time.perf_counter() - began
        self._pending.append(
            self._writer.submit(self._write_layer, layer, tensors, descriptor, bytes_in, stages)
        )

    def _add_stages(self, stages: Mapping[str, float]) -> None:
        """(Under the lock.)"""
        for name, seconds in stages.items():
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + seconds

    def _write_layer(
        self,
        layer: MoELayerPlan,
        tensors: dict[str, Any],
        descriptor: dict[str, Any],
        bytes_in: int,
        stages: dict[str, float],
    ) -> None:
        """Write, hash (both at once: SafetensorsWriter), make durable and record one
        converted layer; its stage times go out with the `converted` event. `write_hash`
        is the writes, with the tensors' SHA-256s running beside them on hashing threads;
        `fsync_rename` includes waiting for the last of those hashes (overlapping the
        fsync)."""
        began = time.perf_counter()
        named = {f"{layer.module}.{name}": tensor for name, tensor in tensors.items()}
        path = self.job.output_dir / layer.file
        self.job.root.check(path.parent, "checkpoint.output_dir")
        metadata = {"format": "pt", "moe_control_backend": self.job.target.backend}
        with SafetensorsWriter(path, [plan_of(n, t) for n, t in named.items()], metadata) as out:
            for name, tensor in named.items():
                self.check()
                out.write(name, tensor_bytes(tensor))
                self.report("writing", name)
            wrote = time.perf_counter()
            stages["write_hash"] = wrote - began
            out.commit()
        committed = time.perf_counter()
        stages["fsync_rename"] = committed - wrote
        self._record(
            layer.unit,
            "moe",
            layer.file,
            layer.files,
            out,
            layer=layer.index,
            module=layer.module,
            num_experts=self.job.num_experts or layer.num_experts,
            descriptor=descriptor,
        )
        stages["journal"] = time.perf_counter() - committed
        with self._lock:
            self.bytes_in += bytes_in
            self.bytes_out += out.data_bytes
            self.descriptor = self.descriptor or descriptor
            self.converted += 1
            self._add_stages(stages)
        self.report(
            "converted",
            layer.file,
            force=True,
            extra={"stages": {name: round(value, 4) for name, value in stages.items()}},
            layers=1,
            nbytes=bytes_in,
        )

    def copy_shard(self, file: str, names: list[str]) -> None:
        unit = f"copy-{file}"
        shard = self.shards[file]
        bytes_in = sum(shard.entries[n].nbytes for n in names)
        self.report("verifying", file)
        record = self.verified(unit, [file])
        if record is not None:
            self._skip(unit, record)
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
        with self._lock:
            self.bytes_in += bytes_in
            self.bytes_out += out.data_bytes
            self._add_stages({"copy_rest": time.perf_counter() - began})
        self._record(unit, "copy", file, [file], out)

    def copy_meta(self, files: list[str]) -> None:
        """Small files, copied as they are (recorded with their SHA-256)."""
        unit = "meta"
        record = self.journal.read(unit) or self.previous.get(unit)
        expected = {name: self.source_identity(name) for name in files}
        if (
            record is not None
            and record.get("job_key") == self.key
            and record.get("sources") == expected
            and all(
                (self.job.output_dir / n).is_file()
                and hash_file(self.job.output_dir / n) == record["files"].get(n)
                for n in files
            )
        ):
            self.records[unit] = record
            return
        digests: dict[str, str] = {}
        for name in files:
            source = self.job.root.child(self.job.input_dir, name, f"checkpoint.input_dir/{name}")
            data = source.read_bytes()
            atomic_write_bytes(self.job.output_dir / name, data)
            digests[name] = hashlib.sha256(data).hexdigest()
        record = {
            "unit": unit,
            "kind": "meta",
            "job_key": self.key,
            "sources": expected,
            "files": digests,
        }
        self.journal.write(unit, record)
        self.records[unit] = record

    # -- the end

    def _all_records(
        self, layers: list[MoELayerPlan], rest: Mapping[str, list[str]]
    ) -> dict[str, dict[str, Any]] | None:
        """Every unit's record (ours, or another range's from the journal); None if any is
        missing."""
        units = [layer.unit for layer in layers] + [f"copy-{file}" for file in sorted(rest)]
        out: dict[str, dict[str, Any]] = {}
        for unit in [*units, "meta"]:
            record = self.records.get(unit) or self.journal.read(unit)
            if record is None or record.get("job_key") != self.key:
                return None
            out[unit] = record
        return out

    def finalize(
        self, layers: list[MoELayerPlan], rest: Mapping[str, list[str]], shards: list[str]
    ) -> Path | None:
        records = self._all_records(layers, rest)
        if records is None:
            return None
        meta = sorted(records["meta"].get("files", {}))
        if self._sources is not None:
            self._sources.result()  # this run's share, in the journal now
        # The files no range hashed (in a spread: the small ones) before the last stage.
        sources = self._source_hashes(source_files(shards, meta), SOURCE_HASH_THREADS)
        self.report("finalizing", MANIFEST_NAME, force=True)
        descriptor = self.descriptor or next(
            (r["descriptor"] for r in records.values() if r.get("descriptor")), None
        )
        weight_map: dict[str, str] = {}
        total = 0
        for record in records.values():
            for name, tensor in record.get("tensors", {}).items():
                weight_map[name] = record["file"]
                total += int(tensor["bytes"])
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        out = self.job.output_dir
        atomic_write_bytes(out / INDEX_NAME, json.dumps(index, indent=2).encode())
        job = self.job
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_by": f"moe-control {__version__}",
            "job_key": self.key,
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
                    "num_experts": records[layer.unit].get("num_experts"),
                }
                for layer in layers
            ],
            "total_size": total,
            "units": list(records.values()),
        }
        atomic_write_bytes(out / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
        self.journal.remove()
        return out / MANIFEST_NAME

    def _source_hashes(self, names: list[str], workers: int = 2) -> list[dict[str, Any]]:
        """SHA-256 of every source file, reusing a hash recorded by an earlier run (the
        previous manifest, or this conversion's journal) when the file's size and mtime are
        unchanged: re-reading a 100 GB checkpoint is not a resume."""
        known: dict[str, dict[str, Any]] = {}
        manifest = self.job.output_dir / MANIFEST_NAME
        if manifest.exists():
            with contextlib.suppress(ConvertInputError, KeyError, TypeError, AttributeError):
                old = _read_json(manifest, "checkpoint.output_dir")
                known = {f["name"]: f for f in old["source"]["files"]}
        wanted = sorted({n for n in names if (self.job.input_dir / n).exists()})

        def one(name: str) -> dict[str, Any]:
            self.check()
            path = self.job.root.child(self.job.input_dir, name, f"checkpoint.input_dir/{name}")
            identity = _file_identity(path)
            for old in (self.journal.read(_source_unit(name)), known.get(name)):
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
            self.journal.write(_source_unit(name), entry)
            with self._lock:
                self._add_stages({"hash_sources": time.perf_counter() - began})
            return entry

        if not wanted:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(wanted)))) as pool:
            return list(pool.map(one, wanted))

    def tensor_list(self, layers: list[MoELayerPlan], copies: list[str]) -> list[dict[str, Any]]:
        units = [layer.unit for layer in layers] + [f"copy-{file}" for file in copies]
        return [
            {"name": name, **tensor}
            for unit in units
            if unit in self.records
            for name, tensor in self.records[unit]["tensors"].items()
        ]
