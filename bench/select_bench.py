"""In-process speed of the oracle: median and p99 of one `select()` per spec kind.

Usage: `make bench` (or `.venv/bin/python bench/select_bench.py [--rounds N]`). It times
already-parsed specs (the decision itself) and raw JSON specs (parsing plus decision), and
appends nothing by itself: copy the printed table into bench/RESULTS.md with the command.

`--handler` times the server's SelectBackend handler instead (selection.py, on the wire
bytes, as grpc calls it): a cache miss (parse, decide, build and serialise the response,
count the metrics) and a cache hit, in CPU time per call, which is what the server pays
besides grpc's own per-call work (bench/load_bench.py measures that part).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

from service.oracle import PLATFORM_PRESETS, PlatformProfile, parse_deployment, select

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


class _OneWorker:
    """The platform source of a server whose one worker is ready with a fixed profile."""

    generation = 0

    def __init__(self, profile: PlatformProfile) -> None:
        self._profile = profile

    def profile(self, index: int) -> PlatformProfile:
        return self._profile

    def default_profile(self) -> PlatformProfile | None:
        return self._profile


def _cpu_per_call(fn: Any, rounds: int, repeats: int = 5) -> float:
    """Median over `repeats` of the process CPU time per call, µs."""
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(rounds):
            fn()
        samples.append((time.process_time() - start) / rounds * 1e6)
    return statistics.median(samples)


def handler_table(rounds: int) -> None:
    import json

    from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
    from service.api.servicer import SelectionServicer as Selection
    from service.metrics import Metrics

    platforms = _OneWorker(PLATFORM_PRESETS["h100"])
    print("| case | handler miss µs CPU | handler hit µs CPU |")
    print("|---|---|---|")
    for name, raw in CASES.items():
        data = pb.SelectBackendRequest(spec_json=json.dumps(raw)).SerializeToString()
        timings = []
        for cache_bytes in (0, 1 << 20):
            selection = Selection(platforms, Metrics(), cache_bytes=cache_bytes)

            def call(selection: Selection = selection, data: bytes = data) -> None:
                coroutine = selection.SelectBackend(data, None)
                with contextlib.suppress(StopIteration):  # it never awaits: run to its return
                    coroutine.send(None)

            for _ in range(200):
                call()
            timings.append(_cpu_per_call(call, rounds))
        print(f"| {name} | {timings[0]:.1f} | {timings[1]:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--handler", action="store_true", help="time the server's handler")
    args = parser.parse_args()
    rounds = args.rounds
    if args.handler:
        handler_table(rounds)
        return
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
