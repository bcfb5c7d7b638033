"""Segment tensors to the device and back (transport.py) on a CPU worker: used in place,
results copied straight into their segment, byte for byte; the pinned size classes.
The pinned (CUDA) path is tests/gpu/test_worker_transport.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.worker import transport
from service.worker.segments import SegmentDir

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


def test_a_target_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="holds 3 bytes"):
        transport.Transport("cpu").to_host(
            torch.zeros(2, dtype=torch.int16), memoryview(bytearray(3))
        )
