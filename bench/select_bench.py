"""In-process speed of the oracle: median and p99 of one `select()` per spec kind.

Usage: `make bench` (or `.venv/bin/python bench/select_bench.py [--rounds N]`). It times
already-parsed specs (the decision itself) and raw JSON specs (parsing plus decision), and
appends nothing by itself: copy the printed table into bench/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from service.oracle import parse_deployment, select

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
            },
        }
    },
    "ignore": ["lm_head"],
}
LAYER = {"num_experts": 60, "top_k": 4, "hidden_size": 2048, "intermediate_size": 1408}
CASES: dict[str, dict[str, Any]] = {
    "gptq a100 (MARLIN)": {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "a100"},
    "gptq h200 (HUMMING)": {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h200"},
    "ct-g32 b200 (MARLIN)": {"hf_quantization_config": CT, "layer": LAYER, "platform": "b200"},
    "gptq mi300x (MoeWNA16/TRITON)": {
        "hf_quantization_config": GPTQ,
        "layer": LAYER,
        "platform": "mi300x",
    },
}


def _time(fn: Any, rounds: int) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20000)
    rounds = parser.parse_args().rounds
    print("| case | decision median µs | decision p99 µs | parse+decision median µs | p99 µs |")
    print("|---|---|---|---|---|")
    for name, raw in CASES.items():
        spec = parse_deployment(raw)
        for _ in range(200):
            select(spec)
        d_med, d_p99 = _time(lambda spec=spec: select(spec), rounds)
        f_med, f_p99 = _time(lambda raw=raw: select(raw), rounds)
        print(f"| {name} | {d_med:.1f} | {d_p99:.1f} | {f_med:.1f} | {f_p99:.1f} |")


if __name__ == "__main__":
    main()
