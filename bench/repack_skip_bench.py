"""The start-up a converted checkpoint saves vLLM: the repack it skips, and what the check costs.

vLLM serving a GPTQ / AWQ / compressed-tensors MoE checkpoint repacks every MoE layer into
its kernel's layout in `process_weights_after_loading`, on the GPU, at every start. Served
from a directory `moe-control convert` wrote (the plugin's ``moe_control`` method) the
tensors load in the kernel layout and that step is skipped; instead the plugin hashes each
converted tensor (SHA-256 on the host, against the manifest) before copying it in.

vLLM's repack ops are not callable here, so our own converters stand in for them (the
proxy: `service.formats.routes.convert.convert`, what the conversion job runs, bit for bit
the same output as vLLM's, on the same device). Per (source layout, target backend), on one
MoE layer of the chosen shape (Mixtral-8x7B unless --quick), this prints:

- repack ms: the median of --rounds conversions of the layer after one warm-up (CUDA
  events on a GPU), and that times --layers: the seconds of start-up skipped;
- check ms: SHA-256 of the converted layer's bytes on the host, on one core (each tensor is
  hashed by one thread), and that times --layers: the CPU seconds the manifest check adds.
  The plugin hashes on up to 8 threads beside the loading, so its wall time is about this
  over min(8, cores) where the disk keeps the threads fed.

    .venv/bin/python bench/repack_skip_bench.py --quick            # CPU smoke run
    .venv/bin/python bench/repack_skip_bench.py                    # CPU, Mixtral-8x7B layer

On the H200 (the device tool carries the working tree and .gpu/, as for
scripts/gpu_convert_bench.sh)::

    source scripts/gpu_env.sh && "$PY" bench/repack_skip_bench.py --device cuda:0 --rounds 10
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert_bench import GB, Timer, bench_layer, nbytes
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.routes.convert import convert
from service.formats.writers import ConvertedLayer

#: Mixtral-8x7B has 32 decoder layers, each with one MoE layer.
MIXTRAL_LAYERS = 32


def host_sha256_seconds(converted: ConvertedLayer) -> float:
    """Seconds to hash every converted tensor's bytes on the host, as the plugin does."""
    host = [
        t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        for t in converted.tensors.values()
    ]
    began = time.perf_counter()
    for tensor in host:
        hashlib.sha256(tensor.numpy().data).digest()
    return time.perf_counter() - began


def measure(
    *,
    source: str,
    target: str,
    tensors: dict[str, torch.Tensor],
    shape: dict[str, int],
    device: torch.device,
    rounds: int,
) -> dict[str, Any]:
    quant = SourceQuantization(bits=4, group_size=shape["group_size"])

    def once() -> ConvertedLayer:
        return convert(source, tensors, quant, target, num_experts=shape["num_experts"])

    converted = once()  # warm-up (and the result the check hashes)
    timer = Timer(device)
    repack = statistics.median(timer(once) for _ in range(rounds))
    check = host_sha256_seconds(converted)
    return {
        "source": source,
        "target": target,
        "GB": nbytes(converted.tensors) / GB,
        "repack_ms": repack * 1e3,
        "check_ms": check * 1e3,
    }


def markdown(rows: list[dict[str, Any]], layers: int, device: torch.device) -> str:
    lines = [
        f"Per MoE layer on {device}, and for {layers} layers (a whole model's start-up):",
        "",
        "| source | target | GB out | repack ms | repack s, all layers | check ms | check s, all |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['target']} | {r['GB']:.3f} | {r['repack_ms']:.1f} | "
            f"{r['repack_ms'] * layers / 1e3:.2f} | {r['check_ms']:.1f} | "
            f"{r['check_ms'] * layers / 1e3:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smaller layer (smoke run)")
    parser.add_argument("--sources", default="gptq,awq,compressed-tensors")
    parser.add_argument("--targets", default="MARLIN,TRITON")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=MIXTRAL_LAYERS)
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape, layer = bench_layer(args.quick, device)
    rows = []
    for source in args.sources.split(","):
        quant = SourceQuantization(bits=4, group_size=shape["group_size"])
        tensors = write_checkpoint(LAYOUTS[source], layer, quant)
        for target in args.targets.split(","):
            print(f"{source} -> {target} ...", file=sys.stderr, flush=True)
            rows.append(
                measure(
                    source=source,
                    target=target,
                    tensors=tensors,
                    shape=shape,
                    device=device,
                    rounds=args.rounds,
                )
            )
        del tensors
    print(f"layer shape: {shape}")
    print(markdown(rows, args.layers, device))
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "layers": args.layers, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
