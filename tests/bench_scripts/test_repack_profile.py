"""bench/repack_profile.py on a tiny layer: its staged call is `try_direct`'s, byte for byte.

The H200 run profiles a Mixtral-8x7B layer (scripts/gpu_convert_bench.sh); here one small
layer per route goes through `profile_pair` on the CPU, the fused kernels under Triton's
interpreter, and the report is checked for what the device run is read for.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import repack_profile

from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.routes import gpu_repack
from service.formats.synthetic.checkpoints import SyntheticSpec, synthetic_layer

SHAPE = {"num_experts": 2, "hidden_size": 128, "intermediate_size": 128, "group_size": 64}


@pytest.mark.parametrize(("source", "target"), [("gptq", "MARLIN"), ("awq", "TRITON")])
def test_profile_pair_on_a_small_layer(
    source: str, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_repack, "KERNEL_DEVICES", {"cuda", "cpu"})
    spec = SyntheticSpec(
        num_experts=SHAPE["num_experts"],
        hidden_size=SHAPE["hidden_size"],
        intermediate_size=SHAPE["intermediate_size"],
        group_size=SHAPE["group_size"],
        fast=True,
    )
    layer = synthetic_layer(spec, torch.Generator().manual_seed(0))
    quant = SourceQuantization(bits=4, group_size=SHAPE["group_size"])
    tensors = write_checkpoint(LAYOUTS[source], layer, quant, naming="mixtral")
    got = repack_profile.profile_pair(
        source,
        target,
        tensors=tensors,
        shape=SHAPE,
        device=torch.device("cpu"),
        rounds=1,
        bandwidth=1e9,
        routes=("direct", "triton", "table"),
    )
    # `table`: the generic kernel the dedicated int4 Marlin kernel replaced, profiled too
    table = {"table"} if target == "MARLIN" else set()
    assert set(got["routes"]) == {"direct", "triton"} | table
    for figures in got["routes"].values():
        assert figures["identical to canonical"] is True
        assert [s["stage"] for s in figures["stages"]] == list(repack_profile.STAGES)
        assert all(s["device ms"] >= 0 and s["host ms"] >= 0 for s in figures["stages"])
        assert figures["weight-only device ms"] > 0
        assert figures["call ms (as the bench)"] > 0
    text = repack_profile.report([got], "header")
    assert f"| {source} | {target} | triton |" in text
    assert "Top kernels" in text
