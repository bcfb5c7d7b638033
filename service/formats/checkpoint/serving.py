"""The converted directory's ``config.json``: what vLLM needs to serve the converted files.

A conversion leaves the model's ``config.json`` as it was except for its
``quantization_config``, which then says what the files are: quantization method
``moe_control`` (registered with vLLM by the plugin, `plugin/moe_control_vllm/checkpoint`),
the kernel backend the MoE layers were converted for, the ruleset that chose it, the source
quantization config (the linear layers, which are copied unchanged, keep the source method),
the MoE tensors' roles and the manifest with its SHA-256::

    "quantization_config": {
      "quant_method": "moe_control",
      "format": "moe-control-checkpoint", "format_version": 1,
      "backend": "MARLIN", "experts_class": "MarlinExperts", "ruleset": "vllm-0.33",
      "source_quantization_config": {"quant_method": "gptq", "bits": 4, ...},
      "source": {"layout": "gptq", "bits": 4, "group_size": 128, "symmetric": true, ...},
      "tensors": {"w13_qweight": "w13_qweight", "w13_scales": "w13_scales", ...},
      "manifest": {"path": "moe-control-manifest.json", "sha256": "...", "bytes": 12345}
    }

``tensors`` maps each kernel tensor name of a MoE layer (the name under the experts module,
as the manifest and the safetensors files hold it) to its role among the ten outputs of
vLLM's ``convert_to_wna16_moe_kernel_format`` (`CONVERSION_SLOTS`), or to null where it has
none (a backend whose conversion vLLM does in place, such as HUMMING): a loader puts each
tensor where vLLM's own conversion would have put that output. The manifest holds every
tensor's dtype, shape and SHA-256; the plugin refuses a manifest whose SHA-256 differs and a
tensor whose bytes do not match the manifest.

The plugin runs in vLLM's environment and cannot import this package, so it reads this
object with its own small reader; a test checks that the two agree on every name here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from service import __version__
from service.formats.checkpoint.plan import (
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointJob,
    read_model_config,
)
from service.formats.io.safetensors import atomic_write_bytes, hash_file

__all__ = [
    "CONVERSION_SLOTS",
    "QUANT_METHOD",
    "SLOT_RENAMES",
    "experts_tensor_names",
    "quantization_config",
    "slot_of",
    "write_model_config",
]

#: The ``quant_method`` of a converted checkpoint: the name the plugin registers with vLLM.
QUANT_METHOD = "moe_control"

#: The outputs of vLLM's ``convert_to_wna16_moe_kernel_format``, in its return order.
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

#: Per backend whose output vLLM returns from that function: the kernel tensor names that
#: are not their slot's name (every other slot-named tensor is its own slot). Backends not
#: listed (HUMMING: vLLM rewrites the layer in place) give their tensors no slot.
SLOT_RENAMES: Mapping[str, Mapping[str, str]] = {
    "TRITON": {},
    "MARLIN": {},
    "BATCHED_MARLIN": {},
    "EMULATION": {"w13_weight": "w13_qweight", "w2_weight": "w2_qweight"},
}


def slot_of(backend: str, name: str) -> str | None:
    """The conversion output a kernel tensor of `backend` stands for (None: none)."""
    renames = SLOT_RENAMES.get(backend)
    if renames is None:
        return None
    slot = renames.get(name, name)
    return slot if slot in CONVERSION_SLOTS else None


def quantization_config(
    job: CheckpointJob,
    *,
    experts_tensors: list[str],
    manifest_sha256: str,
    manifest_bytes: int,
) -> dict[str, Any]:
    """The ``quantization_config`` of the converted directory (see the module doc)."""
    backend = job.target.backend
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"moe-control {__version__}",
        "backend": backend,
        "experts_class": job.target.experts_class,
        "ruleset": job.target.ruleset,
        "source_quantization_config": dict(job.quantization_config),
        "source": job.source.to_json(),
        "tensors": {name: slot_of(backend, name) for name in experts_tensors},
        "manifest": {"path": MANIFEST_NAME, "sha256": manifest_sha256, "bytes": manifest_bytes},
    }


def experts_tensor_names(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The kernel tensor names under each experts module, from the MoE layers' records."""
    names: set[str] = set()
    for record in records:
        if record.get("kind") != "moe":
            continue
        prefix = f"{record['module']}."
        names.update(t.removeprefix(prefix) for t in record.get("tensors", {}))
    return sorted(names)


def write_model_config(
    job: CheckpointJob, manifest_path: Path, records: Iterable[Mapping[str, Any]]
) -> Path:
    """Write the converted directory's config.json: the source's, with the
    `quantization_config` of the converted files (after the manifest, whose hash it holds)."""
    config = read_model_config(job.input_dir, job.root)
    config["quantization_config"] = quantization_config(
        job,
        experts_tensors=experts_tensor_names(records),
        manifest_sha256=hash_file(manifest_path),
        manifest_bytes=manifest_path.stat().st_size,
    )
    path = job.output_dir / CONFIG_NAME
    atomic_write_bytes(path, (json.dumps(config, indent=2) + "\n").encode())
    return path
