#!/usr/bin/env python
"""What the server <-> worker seam adds to a RunMoE forward, without gRPC.

Starts a `WorkerPool` with one real worker process (the device given), keeps a small
synthetic layer on it (convert_layer with keep_loaded), then times `run_moe` calls through
`WorkerHandle.call` one at a time, inputs and output in segments made once: the pipe both
ways, the worker's hand-over to a job thread and its run_moe outside the forward. Prints
the median call time, device time and their difference, and a ping's round trip.

    OMP_NUM_THREADS=1 .venv/bin/python bench/worker_call_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from worker.test_convert_job import params, put_inputs  # noqa: E402
from worker.test_run_job import DEPLOYMENT  # noqa: E402

from service.formats.quantize import random_layer  # noqa: E402
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint  # noqa: E402
from service.worker.segments import SegmentDir  # noqa: E402
from service.worker.supervisor import SupervisorConfig, WorkerPool  # noqa: E402

EXPERTS, HIDDEN = 4, 64


async def measure(device: str, calls: int, warmup: int) -> None:
    pool = WorkerPool([device], SupervisorConfig())
    pool.start()
    try:
        if not await pool.wait_ready(180):
            raise SystemExit("the worker never became ready")
        worker = pool.workers[0]
        segments = SegmentDir.create(Path(tempfile.mkdtemp()))
        layer = random_layer(
            EXPERTS, HIDDEN, HIDDEN, bits=4, group_size=32, symmetric=True,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
        tensors = write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")
        values = params(
            segments,
            put_inputs(segments, tensors),
            backend="EMULATION",
            keep_loaded=True,
            return_tensors=False,
            deployment=DEPLOYMENT,
        )
        values["shape"]["num_experts"] = EXPERTS
        layer_id = (await worker.call("convert_layer", values, cancellable=True))["layer_id"]
        segments.remove("t-in-")
        gen = torch.Generator().manual_seed(0)
        given = {
            "hidden_states": torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16),
            "router_logits": torch.randn(1, EXPERTS, generator=gen),
        }
        segments.new("out", 4096).close()
        run = {
            "segments_dir": str(segments.path),
            "inputs": put_inputs(segments, given),
            "out_segment": "out",
            "out_capacity": 4096,
            "layer_id": layer_id,
        }
        timings = []
        for _ in range(warmup + calls):
            started = time.perf_counter()
            answer = await worker.call(
                "run_moe", run, cancellable=True, on_abandon=lambda late: None
            )
            timings.append((time.perf_counter() - started, float(answer["device_seconds"])))
        timings = timings[warmup:]
        pings = []
        for _ in range(calls):
            started = time.perf_counter()
            await worker.call("ping")
            pings.append(time.perf_counter() - started)
        ms = 1e3
        print(
            f"run_moe M=1: call {statistics.median(t for t, _ in timings) * ms:.3f} ms, "
            f"device {statistics.median(d for _, d in timings) * ms:.3f} ms, "
            f"call - device {statistics.median(t - d for t, d in timings) * ms:.3f} ms; "
            f"ping {statistics.median(pings) * ms:.3f} ms (medians of {calls})"
        )
        segments.destroy()
    finally:
        await pool.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(measure(args.device, args.calls, args.warmup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
