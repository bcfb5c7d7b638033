"""The tuned tables: measured prefill tiles per (device, layer shape, token bucket), as data.

`bench/tune_triton.py` times candidate tiles on a GPU and writes one JSON file per device
name into `configs/`; `tuned_config` reads it (once per process) and gives the row of the
smallest tuned token count at or above the batch, its K tiles refitted to the layer. A layer
shape with no entry takes the heuristic of `config.py`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from service.kernels.interface import LayerSpec
from service.kernels.triton.config import GemmTile, KernelConfig, fit_block_k

#: Where the tuned tables live: one JSON file per device name (bench/tune_triton.py).
CONFIG_DIR = Path(__file__).with_name("configs")


def config_key(spec: LayerSpec, top_k: int) -> str:
    """The tuned table's key for a layer: what the best tiles depend on."""
    return (
        f"E{spec.num_experts}_H{spec.hidden_size}_I{spec.intermediate_size}_k{top_k}"
        f"_int{spec.bits}_g{spec.group_size}"
    )


def config_file(device_name: str) -> Path:
    return CONFIG_DIR / ("".join(c if c.isalnum() else "_" for c in device_name) + ".json")


def config_to_dict(config: KernelConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_dict(data: dict[str, Any]) -> KernelConfig:
    """The inverse of `config_to_dict` (unknown keys are an error: a table from a newer tuner
    must not be half-read)."""
    fields = dict(data)
    w13, w2 = GemmTile(**fields.pop("w13")), GemmTile(**fields.pop("w2"))
    return KernelConfig(w13=w13, w2=w2, **fields)


@functools.cache
def _tuned_tables(device_name: str) -> dict[str, dict[int, KernelConfig]]:
    path = config_file(device_name)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {
        key: {int(m): config_from_dict(cfg) for m, cfg in rows.items()}
        for key, rows in data.get("configs", {}).items()
    }


def tuned_config(
    device_name: str, spec: LayerSpec, num_tokens: int, top_k: int
) -> KernelConfig | None:
    """The shipped tuned tiles for the smallest tuned token count >= `num_tokens` (else the
    largest), K tiles refitted to the layer; None when the table has no entry."""
    rows = _tuned_tables(device_name).get(config_key(spec, top_k))
    if not rows:
        return None
    counts = sorted(rows)
    m = next((c for c in counts if c >= num_tokens), counts[-1])
    config = rows[m]
    h, i = spec.hidden_size, spec.intermediate_size
    g13 = h if spec.group_size == -1 else spec.group_size
    g2 = i if spec.group_size == -1 else spec.group_size
    return replace(
        config,
        w13=replace(config.w13, block_k=fit_block_k(config.w13.block_k, h, g13)),
        w2=replace(config.w2, block_k=fit_block_k(config.w2.block_k, i, g2)),
    )


def tuned_uses_kernel(device_name: str, spec: LayerSpec, kernel: str) -> bool:
    """Whether any of the layer's tuned rows (any top-k) on this device runs `kernel`."""
    tables = _tuned_tables(device_name)
    keys = {config_key(spec, int(k)) for k in _TOP_K.findall(" ".join(tables))}
    return any(cfg.kernel == kernel for key in keys for cfg in tables.get(key, {}).values())


#: The top-k field of a `config_key`.
_TOP_K = re.compile(r"_k(\d+)_")
