"""A whole-checkpoint conversion, planned before any tensor moves (torch-free).

The server process plans a job (`plan_job`: paths confined to the data root, the deployment
read from the model's config.json, the source layout and the target backend resolved) before
it hands the job to a worker, so a bad request fails before any work; the worker reads the
job back (`CheckpointJob.from_json`) and splits the checkpoint into its units
(`find_moe_layers`: one per MoE layer, the other tensors per shard, `meta_files` for the
small files). The names of what the output directory holds live here too, so every module
of the job (and its readers outside) agree on them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.formats.errors import ConvertInputError
from service.formats.io.naming import EXPERT_INDEX, match_expert_tensor
from service.formats.io.paths import DataRoot
from service.formats.routes.spec import SourceSpec, Target, resolve_target, source_spec
from service.oracle import (
    InvalidSpecError,
    PlatformProfile,
    deployment_from_model_config,
    parse_deployment,
)
from service.oracle.json_text import parse_json

__all__ = [
    "CONFIG_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "JOURNAL_DIR",
    "MANIFEST_NAME",
    "CheckpointJob",
    "MoELayerPlan",
    "SourceTensor",
    "find_moe_layers",
    "meta_files",
    "plan_job",
    "read_json",
    "read_model_config",
    "shard_names",
]

MANIFEST_NAME = "moe-control-manifest.json"
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
JOURNAL_DIR = ".moe-control-journal"
FORMAT = "moe-control-checkpoint"
FORMAT_VERSION = 1


def read_json(path: Path, field: str) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConvertInputError(field, f"{path.name} not found in {path.parent}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertInputError(field, f"cannot read {path.name}: {exc}") from None
    try:
        return parse_json(text, path.name)
    except InvalidSpecError as exc:
        raise ConvertInputError(field, f"cannot read {path.name}: {exc}") from None


def read_model_config(input_dir: Path, root: DataRoot, field: str = "checkpoint.input_dir") -> Any:
    """The model's config.json object (confined to the root like every other file)."""
    if not input_dir.is_dir():
        raise ConvertInputError(field, f"{input_dir} is not a directory")
    config = read_json(root.child(input_dir, CONFIG_NAME, field), field)
    if not isinstance(config, dict):
        raise ConvertInputError(field, "config.json does not hold a JSON object")
    return config


def shard_names(input_dir: Path, root: DataRoot, field: str = "checkpoint.input_dir") -> list[str]:
    """The safetensors shards: the index's, else the lone model.safetensors, else every
    *.safetensors in the directory."""
    index = input_dir / INDEX_NAME
    if index.exists():
        data = read_json(root.child(input_dir, INDEX_NAME, field), field)
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


def check_output_dir(input_dir: Path, output_dir: Path) -> None:
    """The output (resolved) is neither the input directory nor inside it: its files would
    be read back as the input's, and a shard of the input could be overwritten."""
    if output_dir == input_dir or output_dir.is_relative_to(input_dir):
        raise ConvertInputError(
            "checkpoint.output_dir",
            f"{output_dir} is inside the input directory {input_dir}; choose one outside it",
        )


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
    check_output_dir(source_dir, target_dir)
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


def meta_files(input_dir: Path, shards: list[str]) -> list[str]:
    """Small top-level files to copy unchanged (tokenizer, generation config). Not
    config.json: the finished run writes it with the converted files' quantization config
    (`serving.write_model_config`)."""
    skip = {*shards, INDEX_NAME, MANIFEST_NAME, CONFIG_NAME}
    return sorted(
        entry.name
        for entry in os.scandir(input_dir)
        if entry.is_file()
        and entry.name not in skip
        and not entry.name.startswith(".")
        and not entry.name.endswith(".safetensors")
    )
