"""Pinned transport on a CUDA worker (service/worker/transport.py): the staging buffers are
page-locked and reused per size class, a segment's bytes reach the device and come back
exactly, a reused buffer is never overwritten while its copy is still queued, and a RunMoE
job on a CUDA worker goes through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from service.ipc.segments import SegmentDir
from service.worker import transport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8]


def _segment_tensor(segments: SegmentDir, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` written into a new segment, then viewed as the worker views an input."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with segments.new(name, len(data)) as segment:
        segment.view[:] = data
    if not data:
        return torch.empty(tensor.shape, dtype=tensor.dtype)  # as run.py does for no bytes
    opened = segments.open(name, len(data))
    return torch.frombuffer(opened.view, dtype=tensor.dtype).reshape(tensor.shape)


def test_staging_buffers_are_pinned_and_reused() -> None:
    pool = transport.PinnedPool()
    first = pool.take(100_000)
    assert first.is_pinned() and first.numel() == transport.size_class(100_000)
    pool.give(first, None)
    again = pool.take(70_000)  # the same 128 KiB class
    assert again.data_ptr() == first.data_ptr() and pool.allocated == 1
    other = pool.take(1 << 20)
    assert other.is_pinned() and pool.allocated == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (257, 2048), (0, 7)], ids=str)
def test_round_trip_is_exact(tmp_path: Path, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    segments = SegmentDir.create(tmp_path)
    moved = transport.Transport("cuda")
    assert moved.pinned
    gen = torch.Generator().manual_seed(1)
    tensor = (torch.randn(shape, generator=gen) * 1000).to(dtype)
    on_device = moved.to_device(_segment_tensor(segments, "in", tensor))
    assert on_device.is_cuda and on_device.dtype == dtype
    assert torch.equal(on_device.cpu(), tensor)
    nbytes = tensor.numel() * tensor.element_size()
    with segments.new("out", nbytes) as segment:
        moved.to_host(on_device, segment.view)
    with segments.open("out", nbytes) as segment:
        data = bytearray(segment.view)
    back = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    assert torch.equal(back.reshape(shape), tensor)


def test_a_reused_buffer_waits_for_its_queued_copy(tmp_path: Path) -> None:
    """Copies queued behind a long kernel all land intact although they share one staging
    buffer: each reuse waits for the previous copy's event."""
    segments = SegmentDir.create(tmp_path)
    moved = transport.Transport("cuda")
    sources = [torch.full((1000,), float(i)) for i in range(6)]
    views = [_segment_tensor(segments, f"s{i}", t) for i, t in enumerate(sources)]
    torch.cuda._sleep(200_000_000)  # keep the stream busy so the copies stay queued
    copies = [moved.to_device(v) for v in views]
    torch.cuda.synchronize()
    for source, copy in zip(sources, copies, strict=True):
        assert torch.equal(copy.cpu(), source)
    assert moved.pool.allocated == 1


def test_run_moe_on_a_cuda_worker_goes_through_pinned_staging(tmp_path: Path) -> None:
    from worker.test_run_job import Rig, inputs, reference

    from service.formats.synthetic.quantize import random_layer
    from service.worker.main import Worker

    layer: Any = random_layer(
        4, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(3)
    )
    rig = Rig(layer, tmp_path)
    rig.worker = Worker("cuda:0", rig.lines)
    layer_id = rig.keep("EMULATION")
    given = inputs(9)
    answer = rig.run(given, layer_id=layer_id)["result"]
    out = rig.output(answer).float()
    want = reference(layer, given)
    assert float((out - want).norm() / want.norm()) < 1e-2
    assert rig.worker.transport.pinned and rig.worker.transport.pool.allocated >= 1
    assert set(rig.worker.streams.describe()) == {"convert", "run"}


@pytest.mark.parametrize("backend", ["MARLIN", "BATCHED_MARLIN", "EMULATION"])
def test_run_moe_on_a_kept_marlin_layer(tmp_path: Path, backend: str) -> None:
    """RunMoE on a CUDA worker for each backend that reads the MARLIN layout, with the
    worker's own reference comparison (EMULATION through the MARLIN reader) and timing."""
    from worker.test_run_job import reference
    from worker.test_transport import _marlin_rig, marlin_inputs

    from service.kernels.marlin import MarlinExperts

    if (
        MarlinExperts.unavailable_reason(torch.device("cuda")) is not None
        and backend != "EMULATION"
    ):
        pytest.skip(str(MarlinExperts.unavailable_reason(torch.device("cuda"))))
    rig, layer_id, layer = _marlin_rig(tmp_path, "cuda:0")
    given = marlin_inputs(37)
    answer = rig.run(given, layer_id=layer_id, backend=backend, compare=True, warmup=1, timed=3)[
        "result"
    ]
    assert answer["backend"] == backend and answer["device_seconds"] > 0
    assert answer["max_abs_error"] < 0.05
    want = reference(layer, given)
    assert float((rig.output(answer).float() - want).norm() / want.norm()) < 1e-2
    assert rig.worker.transport.pool.allocated >= 1


def test_a_tensor_larger_than_the_pool_is_copied_plainly(tmp_path: Path) -> None:
    segments = SegmentDir.create(tmp_path)
    moved = transport.Transport("cuda", transport.PinnedPool(max_bytes=1 << 20))
    tensor = torch.arange(1 << 19, dtype=torch.int32)  # 2 MiB
    on_device = moved.to_device(_segment_tensor(segments, "big", tensor))
    assert torch.equal(on_device.cpu(), tensor) and moved.pool.allocated == 0
    with segments.new("out", 2 << 20) as segment:
        moved.to_host(on_device, segment.view)
        back = torch.frombuffer(bytearray(segment.view), dtype=torch.int32)
    assert torch.equal(back, tensor) and moved.pool.allocated == 0


@pytest.mark.parametrize("shape", [(3, 5), (4096, 2048), (0, 7)], ids=str)
def test_to_file_writes_a_device_tensor_into_a_pooled_segment(
    tmp_path: Path, shape: tuple[int, int]
) -> None:
    """The RunMoE output path (run.py with a lent segment): device -> pinned staging ->
    pwrite into the start of a larger segment; the staging buffer goes back to the pool;
    a tensor larger than the pool is copied plainly."""
    segments = SegmentDir.create(tmp_path)
    gen = torch.Generator().manual_seed(2)
    tensor = (torch.randn(shape, generator=gen) * 1000).to(torch.bfloat16)
    nbytes = tensor.numel() * tensor.element_size()
    for moved in (
        transport.Transport("cuda"),
        transport.Transport("cuda", transport.PinnedPool(1)),
    ):
        with segments.new("pool-out", nbytes + 16) as segment:
            segment.view[:] = b"\xee" * (nbytes + 16)
        moved.to_file(tensor.cuda(), lambda data: segments.write("pool-out", data))
        with segments.open("pool-out", nbytes + 16) as segment:
            raw = bytes(segment.view)
        assert raw[nbytes:] == b"\xee" * 16
        if nbytes:
            back = torch.frombuffer(bytearray(raw[:nbytes]), dtype=torch.bfloat16)
            assert torch.equal(back.reshape(shape), tensor)
        segments.remove("pool-out")


def test_inputs_go_together_in_one_copy(tmp_path: Path) -> None:
    """`to_device_all` (run.py's inputs): every dtype and shape, empty ones included, lands
    exactly, each view PACK_ALIGN-aligned, through one staging buffer; copies queued behind
    a long kernel reuse that buffer only once their copy is done; inputs bigger than the
    pool together go one by one."""
    segments = SegmentDir.create(tmp_path)
    moved = transport.Transport("cuda")
    gen = torch.Generator().manual_seed(4)
    tensors = {
        f"t{i}": (torch.randn(shape, generator=gen) * 100).to(dtype)
        for i, (dtype, shape) in enumerate(
            zip(DTYPES, [(1, 2048), (3, 5), (1, 128), (0, 7), (2, 8), (1, 3)], strict=True)
        )
    }
    hosts = {k: _segment_tensor(segments, k, t) for k, t in tensors.items()}
    torch.cuda._sleep(200_000_000)
    rounds = [moved.to_device_all(hosts) for _ in range(4)]
    torch.cuda.synchronize()
    for out in rounds:
        assert list(out) == list(tensors)
        for name, tensor in tensors.items():
            assert out[name].is_cuda and out[name].dtype == tensor.dtype
            assert torch.equal(out[name].cpu(), tensor)
            assert out[name].data_ptr() % transport.PACK_ALIGN == 0
    assert moved.pool.allocated == 1
    small = transport.Transport("cuda", transport.PinnedPool(max_bytes=4 << 10))
    out = small.to_device_all(hosts)  # 5.25 KiB packed > 4 KiB: one by one
    for name, tensor in tensors.items():
        assert torch.equal(out[name].cpu(), tensor)


@pytest.mark.parametrize("case", ["inf_logits", "ids_range", "nan", "logits_shape"])
def test_input_errors_on_a_cuda_worker(tmp_path: Path, case: str) -> None:
    """The checks read the host copies of the inputs (no device synchronisation): the same
    errors, fields and healthy worker as on the CPU."""
    from worker.test_run_job import INPUT_ERRORS, Rig, check_input_error

    from service.formats.synthetic.quantize import random_layer

    layer: Any = random_layer(
        4, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(3)
    )
    rig = Rig(layer, tmp_path, "cuda:0")
    _, category, field = next(row for row in INPUT_ERRORS if row[0] == case)
    check_input_error(rig, rig.keep("EMULATION"), case, category, field)


def test_pooled_segments_refilled_on_a_cuda_worker(tmp_path: Path) -> None:
    """Kept mappings of the server's pooled segments on a CUDA worker: each call's own
    inputs reach the device (packed copy) and its own output lands in the lent segment."""
    from worker.test_run_job import Rig, check_refilled_segments

    from service.formats.synthetic.quantize import random_layer

    layer: Any = random_layer(
        4, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(3)
    )
    check_refilled_segments(Rig(layer, tmp_path, "cuda:0"), layer)


@pytest.mark.parametrize("where", ["host", "device"])
def test_routing_on_the_host_or_the_device_gives_the_same_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A CUDA worker routes small calls on the host (HOST_ROUTING_MAX_SCORES) and big ones
    on the device: the same forward, the same checks, one device wait (run._Timer)."""
    from worker.test_run_job import check_routing_paths

    from service.worker import run

    if where == "device":
        monkeypatch.setattr(run, "HOST_ROUTING_MAX_SCORES", 0)
    check_routing_paths(tmp_path, "cuda:0")
