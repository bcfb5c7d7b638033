#!/usr/bin/env python
"""What the server <-> worker seam adds to a RunMoE forward, without gRPC, stage by stage.

Starts a `WorkerPool` with one real worker process (the device given), keeps a synthetic
layer on it (convert_layer with keep_loaded), then times `run_moe` calls through
`WorkerHandle.call` one at a time at M = 1, inputs and output in segments made once: the
pipe both ways, the worker's hand-over to a job thread and its run_moe around the forward.
Prints the median call time, device time and their difference, a ping's round trip, and
the medians of the stages the worker's answer reports (`stages`, service/worker/run.py:
host seconds per stage; on a GPU the copy to the device and the forward only launch work,
and "output" holds the call's one wait for the device: its copy back waits for the
forward; small calls are routed on the host, before the copy). "pipe + hand-over" is the
call minus the stages' sum.

    OMP_NUM_THREADS=1 .venv/bin/python bench/worker_call_overhead.py          # CPU, 4x64x64
    python3 bench/worker_call_overhead.py --device cuda:0 --shape qwen3     # TRITON, g128

`--shape qwen3` is Qwen3-30B-A3B's layer (128 experts, top 8, H 2048, I 768, GPTQ int4
g128), kept as TRITON by default (`--backend`); the default `small` is 4 experts, top 2,
H = I = 64, int4 g32, EMULATION.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from worker.test_convert_job import params, put_inputs  # noqa: E402

from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint  # noqa: E402
from service.formats.routes.spec import SourceSpec  # noqa: E402
from service.formats.synthetic.checkpoints import SyntheticSpec, synthetic_layer  # noqa: E402
from service.formats.synthetic.quantize import random_layer  # noqa: E402
from service.ipc import codec  # noqa: E402
from service.ipc.messages import ConvertLayer, Ping, RunMoE, SegmentTensor  # noqa: E402
from service.ipc.segments import SegmentDir  # noqa: E402
from service.pool.config import SupervisorConfig  # noqa: E402
from service.pool.pool import WorkerPool  # noqa: E402

#: name -> (experts, top_k, hidden, intermediate, group_size, default backend)
SHAPES: dict[str, tuple[int, int, int, int, int, str]] = {
    "small": (4, 2, 64, 64, 32, "EMULATION"),
    "qwen3": (128, 8, 2048, 768, 128, "TRITON"),
}


def make_layer(experts: int, hidden: int, intermediate: int, group: int) -> Any:
    """Random int4 weights; the big shape through the synthetic fast path (seconds, not
    minutes, of quantization on the host)."""
    if experts * hidden * intermediate <= 1 << 20:
        return random_layer(
            experts, hidden, intermediate, bits=4, group_size=group, symmetric=True,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
    spec = SyntheticSpec(
        num_experts=experts, top_k=2, hidden_size=hidden, intermediate_size=intermediate,
        group_size=group, fast=True, dtype=torch.bfloat16,
    )  # fmt: skip
    return synthetic_layer(spec, torch.Generator().manual_seed(3))


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.3f}"


async def measure(device: str, shape: str, backend: str, calls: int, warmup: int) -> None:
    experts, top_k, hidden, intermediate, group, default_backend = SHAPES[shape]
    backend = backend or default_backend
    pool = WorkerPool([device], SupervisorConfig(start_timeout_s=300))
    pool.start()
    # Where the server keeps its own: /dev/shm when it has room.
    segments = SegmentDir.create(prefer_shm=1 << 30)
    try:
        if not await pool.wait_ready(300):
            raise SystemExit("the worker never became ready")
        worker = pool.workers[0]
        started = time.perf_counter()
        layer = make_layer(experts, hidden, intermediate, group)
        tensors = write_checkpoint(GPTQ, layer, SourceQuantization(4, group), naming="mixtral")
        deployment = {
            "layer": {
                "top_k": top_k,
                "activation": "silu",
                "routing": {"renormalize": True, "scoring_func": "softmax"},
            }
        }
        values = params(
            segments,
            put_inputs(segments, tensors),
            source=SourceSpec("gptq", 4, group).to_json(),
            backend=backend,
            keep_loaded=True,
            return_tensors=False,
            deployment=deployment,
        )
        values["shape"].update(
            num_experts=experts, hidden_size=hidden, intermediate_size=intermediate
        )
        layer_id = (await worker.call(codec.from_json(ConvertLayer, values))).layer_id
        segments.remove("t-in-")
        del layer, tensors
        print(f"layer kept ({backend}) in {time.perf_counter() - started:.1f} s", flush=True)
        gen = torch.Generator().manual_seed(0)
        given = {
            "hidden_states": torch.randn(1, hidden, generator=gen).to(torch.bfloat16),
            "router_logits": torch.randn(1, experts, generator=gen),
        }
        capacity = max(4096, 2 * hidden)
        segments.new("out", capacity).close()
        run = RunMoE(
            segments_dir=str(segments.path),
            inputs=tuple(
                codec.from_json(SegmentTensor, item) for item in put_inputs(segments, given)
            ),
            out_segment="out",
            out_capacity=capacity,
            layer_id=layer_id,
        )
        timings: list[tuple[float, float]] = []
        stages: dict[str, list[float]] = {}
        for number in range(warmup + calls):
            started = time.perf_counter()
            answer = await worker.call(run, on_abandon=lambda late: None)
            wall = time.perf_counter() - started
            if number < warmup:  # JIT, autotuning, caches
                continue
            timings.append((wall, answer.device_seconds))
            for stage, seconds in answer.stages.items():
                stages.setdefault(stage, []).append(seconds)
            stages.setdefault("pipe + hand-over", []).append(wall - sum(answer.stages.values()))
        pings = []
        for _ in range(calls):
            started = time.perf_counter()
            await worker.call(Ping())
            pings.append(time.perf_counter() - started)
        print(
            f"run_moe M=1 on {device} ({shape}: E={experts} k={top_k} H={hidden} "
            f"I={intermediate} int4 g{group}, {answer.backend}): "
            f"call {_ms([t for t, _ in timings])} ms, device {_ms([d for _, d in timings])} ms, "
            f"call - device {_ms([t - d for t, d in timings])} ms; ping {_ms(pings)} ms "
            f"(medians of {calls})"
        )
        print("\n| stage | median ms | p90 ms |\n|---|---|---|")
        for stage, values in stages.items():
            p90 = sorted(values)[min(len(values) - 1, int(0.9 * len(values)))]
            print(f"| {stage} | {_ms(values)} | {p90 * 1e3:.3f} |")
    finally:
        segments.destroy()
        await pool.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu", help="the worker's device, e.g. cuda:0")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--backend", default="", help="the kept layer's; default per shape")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(measure(args.device, args.shape, args.backend, args.calls, args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
