"""Reading a converted checkpoint's ``quantization_config`` and manifest (JSON only).

This runs inside vLLM's environment, which does not have moe-control: the format is
declared once, by moe-control (`service/formats/checkpoint/serving.py` and `plan.py`), and
read here by a reader of our own; a test checks that the names below agree with that side.
Nothing here imports torch or vLLM, so the reader is usable (and tested) anywhere.

What is checked before any tensor is read: the format and its version, the backend, the
manifest's SHA-256 against the one config.json holds, and that the manifest describes the
same conversion (backend, every MoE layer's tensors with a dtype, shape and SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CONVERSION_SLOTS",
    "FORMAT",
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "ConvertedCheckpointError",
    "ConvertedLayer",
    "Manifest",
    "ServingConfig",
    "TensorRecord",
]

QUANT_METHOD = "moe_control"
FORMAT = "moe-control-checkpoint"
FORMAT_VERSION = 1

#: The outputs of vLLM's ``convert_to_wna16_moe_kernel_format``, in its return order: the
#: roles a converted tensor can stand for.
CONVERSION_SLOTS = (
    "w13_qweight",
    "w2_qweight",
    "w13_scales",
    "w2_scales",
    "w13_qzeros",
    "w2_qzeros",
    "w13_input_global_scale",
    "w2_input_global_scale",
    "w13_bias",
    "w2_bias",
)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ConvertedCheckpointError(ValueError):
    """A converted checkpoint that cannot be served as it is (the message says why)."""


@dataclass(frozen=True)
class TensorRecord:
    """One kernel tensor of a MoE layer, as the manifest records it."""

    #: The name under the experts module (``w13_qweight``).
    name: str
    #: The full checkpoint name (``model.layers.0.mlp.experts.w13_qweight``).
    checkpoint_name: str
    #: safetensors dtype code (``U8``, ``I32``, ``F16``, ``BF16``...).
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    #: Its role among `CONVERSION_SLOTS`.
    slot: str


@dataclass(frozen=True)
class ConvertedLayer:
    """One converted MoE layer: its experts module and kernel tensors."""

    index: int
    module: str
    file: str
    tensors: Mapping[str, TensorRecord]


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConvertedCheckpointError(f"{where}: {key!r} missing or not a {kind.__name__}")
    return value


@dataclass(frozen=True)
class ServingConfig:
    """The ``quantization_config`` of a converted checkpoint's config.json."""

    backend: str
    experts_class: str
    ruleset: str
    #: The source checkpoint's quantization config (its linear layers keep that method).
    source_quantization_config: Mapping[str, Any]
    #: Kernel tensor name -> its slot (None: no slot; such a layout cannot be loaded).
    tensors: Mapping[str, str | None]
    manifest_path: str
    manifest_sha256: str

    @classmethod
    def from_quantization_config(cls, obj: Mapping[str, Any]) -> ServingConfig:
        where = "config.json quantization_config"
        if obj.get("quant_method") != QUANT_METHOD:
            raise ConvertedCheckpointError(f"{where}: quant_method is not {QUANT_METHOD!r}")
        if obj.get("format") != FORMAT or obj.get("format_version") != FORMAT_VERSION:
            raise ConvertedCheckpointError(
                f"{where}: format {obj.get('format')!r} version {obj.get('format_version')!r}; "
                f"this plugin reads {FORMAT!r} version {FORMAT_VERSION}"
            )
        source = _field(obj, "source_quantization_config", dict, where)
        _field(source, "quant_method", str, f"{where}.source_quantization_config")
        tensors = _field(obj, "tensors", dict, where)
        for name, slot in tensors.items():
            if slot is not None and slot not in CONVERSION_SLOTS:
                raise ConvertedCheckpointError(
                    f"{where}: tensor {name!r} has unknown slot {slot!r}"
                )
        manifest = _field(obj, "manifest", dict, where)
        return cls(
            backend=_field(obj, "backend", str, where),
            experts_class=str(obj.get("experts_class", "")),
            ruleset=str(obj.get("ruleset", "")),
            source_quantization_config=dict(source),
            tensors=dict(tensors),
            manifest_path=_field(manifest, "path", str, f"{where}.manifest"),
            manifest_sha256=_field(manifest, "sha256", str, f"{where}.manifest"),
        )

    @property
    def source_method(self) -> str:
        """vLLM's quantization method of the source checkpoint ("gptq", "awq"...)."""
        return str(self.source_quantization_config["quant_method"])


@dataclass(frozen=True)
class Manifest:
    """The converted MoE layers of a checkpoint, by experts module."""

    backend: str
    layers: Mapping[str, ConvertedLayer]

    @classmethod
    def load(cls, model_dir: Path, config: ServingConfig) -> Manifest:
        """Read and check the manifest `config` names, in `model_dir`."""
        path = model_dir / config.manifest_path
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConvertedCheckpointError(f"cannot read the manifest {path}: {exc}") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != config.manifest_sha256:
            raise ConvertedCheckpointError(
                f"{path}: SHA-256 {digest} is not the {config.manifest_sha256} config.json "
                "records: the manifest was changed after the conversion"
            )
        try:
            manifest = json.loads(data)
        except ValueError as exc:
            raise ConvertedCheckpointError(f"{path}: not JSON: {exc}") from None
        return cls.from_json(manifest, config, str(path))

    @classmethod
    def from_json(cls, manifest: Mapping[str, Any], config: ServingConfig, where: str) -> Manifest:
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise ConvertedCheckpointError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} manifest")
        if manifest.get("backend") != config.backend:
            raise ConvertedCheckpointError(
                f"{where}: backend {manifest.get('backend')!r}, config.json says {config.backend!r}"
            )
        units = {
            u.get("module"): u
            for u in _field(manifest, "units", list, where)
            if u.get("kind") == "moe"
        }
        layers: dict[str, ConvertedLayer] = {}
        for entry in _field(manifest, "layers", list, where):
            module = _field(entry, "module", str, f"{where} layer")
            unit = units.get(module)
            if unit is None:
                raise ConvertedCheckpointError(f"{where}: no record of the layer {module}")
            tensors = {}
            for checkpoint_name, record in _field(unit, "tensors", dict, module).items():
                name = checkpoint_name.removeprefix(f"{module}.")
                slot = config.tensors.get(name)
                if slot is None:
                    raise ConvertedCheckpointError(
                        f"{checkpoint_name}: no vLLM parameter takes this {config.backend} "
                        "tensor (config.json gives it no slot)"
                    )
                tensors[name] = TensorRecord(
                    name=name,
                    checkpoint_name=checkpoint_name,
                    dtype=_field(record, "dtype", str, checkpoint_name),
                    shape=tuple(int(d) for d in _field(record, "shape", list, checkpoint_name)),
                    sha256=_field(record, "sha256", str, checkpoint_name),
                    slot=slot,
                )
            layers[module] = ConvertedLayer(
                int(entry["index"]), module, str(entry["file"]), tensors
            )
        return cls(backend=config.backend, layers=layers)

    def layer_for(self, prefix: str) -> ConvertedLayer:
        """The converted layer of vLLM's experts module `prefix`: the module of that name,
        else the one converted layer with the same decoder layer index (a model whose vLLM
        module names differ from its checkpoint's, e.g. a language model inside a
        multimodal one)."""
        found = self.layers.get(prefix)
        if found is not None:
            return found
        match = _LAYER_INDEX.search(prefix)
        if match is not None:
            same = [layer for layer in self.layers.values() if layer.index == int(match[1])]
            if len(same) == 1:
                return same[0]
        raise ConvertedCheckpointError(
            f"the manifest has no converted MoE layer for vLLM's {prefix!r} "
            f"(it converted {len(self.layers)} layers)"
        )
