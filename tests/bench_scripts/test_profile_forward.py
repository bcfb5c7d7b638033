"""bench/profile_forward.py: the trace reading the H200 run depends on, and one CPU point.

The per-node split is read from a torch.profiler Chrome trace that only a GPU produces; here
a synthetic trace in that format (device events of categories kernel / gpu_memset between
the flush kernels that mark replays) checks the split into replays, the per-position
medians, gaps and span. Then one decode point runs end to end under the interpreter
(correctness against the fp32 reference; no flush buffer given: no profile).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    # Kernel modules an earlier test imported compiled-mode, in dependency order.
    for _name in (
        "service.kernels.align",
        "service.kernels.triton.jit",
        "service.kernels.triton.prefill",
        "service.kernels.triton.decode",
    ):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_forward as pf


def _trace(durations: list[list[tuple[str, float]]], gap: float) -> dict[str, object]:
    events: list[dict[str, object]] = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::zero_", "ts": 0.0, "dur": 500.0}
    ]
    t = 10.0
    for replay in durations:
        events.append({"ph": "X", "cat": "kernel", "name": pf.FLUSH_NAME, "ts": t, "dur": 60.0})
        t += 70.0
        for name, dur in replay:
            cat = "gpu_memset" if name.startswith("Memset") else "kernel"
            events.append({"ph": "X", "cat": cat, "name": name, "ts": t, "dur": dur})
            t += dur + gap
    return {"traceEvents": events}


def test_nodes_from_trace_splits_replays_at_the_flush_kernel() -> None:
    replays = [
        [("_moe_w13_kernel", 10.0 + r), ("Memset (Device)", 1.0),
         ("void at::native::vectorized_elementwise_kernel<4, Cast>(int, Cast)", 2.0)]
        for r in (0, 4, 1)
    ]  # fmt: skip
    nodes, span, note = pf.nodes_from_trace(_trace(replays, gap=1.5))
    assert [n.name for n in nodes] == ["_moe_w13_kernel", "Memset", "vectorized_elementwise_kernel"]
    assert [n.us for n in nodes] == [11.0, 1.0, 2.0]  # medians over the replays
    assert [n.gap_us for n in nodes] == [0.0, 1.5, 1.5]
    assert span == pytest.approx(11.0 + 1.0 + 2.0 + 2 * 1.5)
    assert note == ""


def test_nodes_from_trace_without_device_events() -> None:
    nodes, _, note = pf.nodes_from_trace({"traceEvents": []})
    assert nodes == [] and "no device events" in note


def test_one_decode_point_checked() -> None:
    name, shape = pf.SHAPES["tiny"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tensors, spec = pf.kernel_check.make_layer(shape, pf.kernel_check.PRIMARY, device, 0)
    canonical = pf.triton_to_canonical(tensors, bits=4, group_size=128)
    reference = pf.EmulationExperts()
    reference.prepare(canonical, pf.LayerSpec.from_canonical(canonical))
    config = pf.choose_config_decode(1, shape[3], spec, 4)
    result = pf.run_point(name, 1, "decode", config, tensors, spec, reference,
                          device, 1, None, 0)  # fmt: skip
    assert result.passed, result
    assert result.rel_err < 1e-2 and result.nodes == []
    assert "decode" in pf.table([result])
