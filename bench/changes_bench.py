"""The cost of `what_would_change`: the oracle's plain decision (the floor) against the same
decision with the search for the smallest changes that make each other backend win.

    .venv/bin/python bench/changes_bench.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from service.oracle import select

CONFIG = Path(__file__).resolve().parents[1] / "docs/examples/fleet/qwen3-30b-a3b-gptq-int4.json"
SPEC = {
    "hf_quantization_config": json.loads(CONFIG.read_text())["quantization_config"],
    "layer": {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768},
    "platform": "h200",
}
ROUNDS = 30


def median_ms(what_would_change: bool) -> float:
    select(SPEC, what_would_change=what_would_change)  # warm-up
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        select(SPEC, what_would_change=what_would_change)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print("| call | median |\n| --- | --- |")
    print(f"| `select(spec)` (the floor) | {median_ms(False):.2f} ms |")
    print(f"| `select(spec, what_would_change=True)` | {median_ms(True):.1f} ms |")


if __name__ == "__main__":
    main()
