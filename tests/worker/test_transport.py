"""Segment tensors to the device and back (transport.py) on a CPU worker: used in place,
results copied straight into their segment, byte for byte; the pinned size classes.
The pinned (CUDA) path is tests/gpu/test_worker_transport.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from service.ipc.errors import SegmentError
from service.ipc.segments import SegmentDir
from service.worker import transport

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8]


def test_size_classes_are_powers_of_two_from_64_kib() -> None:
    assert transport.size_class(0) == 64 << 10
    assert transport.size_class(1) == 64 << 10
    assert transport.size_class(64 << 10) == 64 << 10
    assert transport.size_class((64 << 10) + 1) == 128 << 10
    assert transport.size_class(5 << 20) == 8 << 20


def test_cpu_inputs_are_used_in_place() -> None:
    moved = transport.Transport("cpu")
    assert not moved.pinned
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert moved.to_device(host) is host


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_output_lands_in_its_segment_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    segments = SegmentDir.create(tmp_path)
    gen = torch.Generator().manual_seed(0)
    tensor = (torch.randn((7, 33), generator=gen) * 100).to(dtype)
    nbytes = tensor.numel() * tensor.element_size()
    with segments.new("out", nbytes) as segment:
        transport.Transport("cpu").to_host(tensor, segment.view)
    with segments.open("out", nbytes) as segment:
        back = torch.frombuffer(bytearray(segment.view), dtype=dtype).reshape(7, 33)
    assert torch.equal(back, tensor)


def test_non_contiguous_and_empty_outputs(tmp_path: Path) -> None:
    segments = SegmentDir.create(tmp_path)
    tensor = torch.arange(24, dtype=torch.int32).reshape(4, 6).t()
    with segments.new("t", 96) as segment:
        transport.Transport("cpu").to_host(tensor, segment.view)
        back = torch.frombuffer(bytearray(segment.view), dtype=torch.int32).reshape(6, 4)
    assert torch.equal(back, tensor)
    transport.Transport("cpu").to_host(torch.empty(0, 5), memoryview(bytearray()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_output_written_into_a_larger_pooled_segment(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """to_file + SegmentDir.write: the bytes at the start of the file, the rest untouched;
    non-contiguous and empty outputs too."""
    segments = SegmentDir.create(tmp_path)
    gen = torch.Generator().manual_seed(1)
    tensor = (torch.randn((33, 7), generator=gen) * 100).to(dtype).t()
    nbytes = tensor.numel() * tensor.element_size()
    with segments.new("pool-out", nbytes + 64) as segment:
        segment.view[:] = b"\xee" * (nbytes + 64)
    moved = transport.Transport("cpu")
    moved.to_file(tensor, lambda data: segments.write("pool-out", data))
    moved.to_file(torch.empty(0, 3, dtype=dtype), lambda data: segments.write("pool-out", data))
    with segments.open("pool-out", nbytes + 64) as segment:
        raw = bytes(segment.view)
    back = torch.frombuffer(bytearray(raw[:nbytes]), dtype=dtype).reshape(7, 33)
    assert torch.equal(back, tensor) and raw[nbytes:] == b"\xee" * 64
    with pytest.raises(SegmentError, match="holds"):
        segments.write("pool-out", memoryview(bytes(nbytes + 65)))


def test_a_target_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="holds 3 bytes"):
        transport.Transport("cpu").to_host(
            torch.zeros(2, dtype=torch.int16), memoryview(bytearray(3))
        )


def _marlin_rig(tmp_path: Path, device: str) -> tuple[Any, str, Any]:
    """A worker on `device` keeping a MARLIN layer (hidden 128: Marlin's minimum)."""
    from service.formats.synthetic.quantize import random_layer
    from service.worker.main import Worker
    from worker.test_run_job import Rig

    layer = random_layer(
        4, 128, 128, bits=4, group_size=32, symmetric=True,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    rig = Rig(layer, tmp_path)
    rig.worker = Worker(device, rig.lines)
    shape = {"num_experts": 4, "hidden_size": 128, "intermediate_size": 128, "gated": True}
    answer = rig.keep_answer("MARLIN", shape=shape)  # GPTQ int4, group 32, symmetric
    assert "result" in answer, answer
    return rig, str(answer["result"]["layer_id"]), layer


def marlin_inputs(tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    return {
        "hidden_states": torch.randn(tokens, 128, generator=gen).to(torch.bfloat16),
        "router_logits": torch.randn(tokens, 4, generator=gen),
    }


def test_cpu_worker_runs_emulation_on_a_kept_marlin_layer(tmp_path: Path) -> None:
    """Inputs in place, output straight into its segment; EMULATION reads the MARLIN layout
    through the reference reader, so the layer is checked on the worker that holds it."""
    from worker.test_run_job import reference

    rig, layer_id, layer = _marlin_rig(tmp_path, "cpu")
    given = marlin_inputs(6)
    answer = rig.run(given, layer_id=layer_id, backend="EMULATION", compare=True)["result"]
    assert answer["backend"] == "EMULATION" and answer["max_abs_error"] < 0.05
    want = reference(layer, given)
    assert float((rig.output(answer).float() - want).norm() / want.norm()) < 1e-2
    assert rig.worker.transport.pool.allocated == 0  # no pinned staging on a CPU worker


def test_cpu_inputs_go_together_in_place() -> None:
    """`to_device_all` on a CPU worker: every input is the segment view itself."""
    moved = transport.Transport("cpu")
    hosts = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 3, dtype=torch.int32)}
    out = moved.to_device_all(hosts)
    assert list(out) == ["a", "b"] and all(out[k] is hosts[k] for k in hosts)
