"""Host <-> device copies of segment tensors through pinned (page-locked) staging buffers.

Tensors reach a worker as files in the server's shared-memory segment directory (ipc/segments.py)
and stay there as the carrier. A GPU can only DMA from page-locked memory: a copy from an
ordinary mapping is staged by the driver through its own pinned bounce buffer and blocks the
calling thread until it is done, whatever stream it was issued on. So a CUDA worker copies
each segment into a pinned staging buffer of ours (a CPU memcpy out of shared memory) and
issues the host -> device copy from there asynchronously on the job's stream; the output
comes back the same way (device -> pinned, asynchronously, then into its segment once the
stream has reached that point). Registering the segment mappings themselves
(`cudaHostRegister`) would save the CPU memcpy but pins and unpins pages on every call, and
the input mappings are private copy-on-write maps that must not be written; a pool of
buffers allocated once is the cheaper steady state for RunMoE-sized tensors.

Buffers are kept per size class (powers of two from 64 KiB), each handed to one copy at a
time: a buffer goes back to the pool with the CUDA event recorded after its copy and is
reused only once that event has completed. The pool holds at most `max_bytes` of idle
buffers; beyond that returned buffers are dropped (torch's pinned-memory cache keeps them),
and a tensor larger than `max_bytes` is copied plainly.

A call's inputs go together (`to_device_all`): packed into one staging buffer and sent
with one host -> device copy, each tensor a view of one device buffer, rather than one
buffer, copy and event per tensor (each costs host time that dominates a small call;
bench/RESULTS.md has the figures).

On a CPU worker nothing changes: a segment tensor is used in place, and the output is
copied straight into its segment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_CLASS_BYTES = 64 << 10
DEFAULT_POOL_BYTES = 256 << 20
#: Where each tensor starts in a packed device buffer: a multiple of this many bytes, so
#: every view is as aligned as a tensor of its own (kernels load 16-byte vectors; the
#: caching allocator hands out 512-byte aligned blocks).
PACK_ALIGN = 256


def size_class(nbytes: int) -> int:
    """The staging buffer size that holds `nbytes`: a power of two, at least 64 KiB."""
    size = MIN_CLASS_BYTES
    while size < nbytes:
        size <<= 1
    return size


@dataclass
class _Idle:
    buffer: torch.Tensor
    event: torch.cuda.Event | None


class PinnedPool:
    """Pinned uint8 host buffers by size class, each lent to one copy at a time."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[_Idle]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0
        """Buffers allocated so far (a reused one is not counted again)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of at least `nbytes` (its size class), free for this copy."""
        size = size_class(nbytes)
        with self._lock:
            idle = self._idle.get(size)
            found = idle.pop() if idle else None
            if found is not None:
                self._idle_bytes -= size
            else:
                self.allocated += 1
        if found is None:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if found.event is not None:
            found.event.synchronize()
        return found.buffer

    def give(self, buffer: torch.Tensor, event: torch.cuda.Event | None) -> None:
        """Return `buffer`; it is reused once `event` (recorded after its last copy) is done."""
        size = int(buffer.numel())
        with self._lock:
            if self._idle_bytes + size > self.max_bytes:
                return
            self._idle.setdefault(size, []).append(_Idle(buffer, event))
            self._idle_bytes += size

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's data as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


class Transport:
    """Moves segment tensors to the worker's device and results back into segments."""

    def __init__(self, device: str | torch.device, pool: PinnedPool | None = None) -> None:
        self.device = torch.device(device)
        self.pool = pool if pool is not None else PinnedPool()

    @property
    def pinned(self) -> bool:
        """Whether copies go through pinned staging (a CUDA device)."""
        return self.device.type == "cuda"

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` (a view of a segment) on the device; on the CPU, `host` itself.

        The copy is issued on the current stream and returns before it completes; work
        queued after it on that stream sees the data.
        """
        nbytes = host.numel() * host.element_size()
        if not self.pinned or nbytes > self.pool.max_bytes:
            # Larger than the whole pool: one plain (staged by the driver) copy rather than
            # a pinned allocation of up to twice its size.
            return host.to(self.device)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if nbytes == 0:
            return out
        staging = self.pool.take(nbytes)
        staging[:nbytes].copy_(_bytes_of(host.contiguous()))
        _bytes_of(out).copy_(staging[:nbytes], non_blocking=True)
        self.pool.give(staging, self._recorded())
        return out

    def to_device_all(self, hosts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each of `hosts` (views of segments) on the device; on the CPU, themselves.

        One pinned staging buffer, one host -> device copy and one event for them all; on
        the device each tensor is a view of one buffer, starting at a multiple of
        PACK_ALIGN bytes. Issued on the current stream like `to_device`. Inputs that do not
        fit in the pool together go one by one.
        """
        if not self.pinned:
            return dict(hosts)
        places: list[tuple[str, torch.Tensor, int, int]] = []
        total = 0
        for name, host in hosts.items():
            nbytes = host.numel() * host.element_size()
            places.append((name, host, total, nbytes))
            total += -(-nbytes // PACK_ALIGN) * PACK_ALIGN
        if total == 0 or total > self.pool.max_bytes:
            return {name: self.to_device(host) for name, host in hosts.items()}
        staging = self.pool.take(total)
        packed = torch.empty(total, dtype=torch.uint8, device=self.device)
        out: dict[str, torch.Tensor] = {}
        for name, host, start, nbytes in places:
            if nbytes:
                staging[start : start + nbytes].copy_(_bytes_of(host.contiguous()))
            view = packed[start : start + nbytes].view(host.dtype)
            out[name] = view.reshape(host.shape)
        packed.copy_(staging[:total], non_blocking=True)
        self.pool.give(staging, self._recorded())
        return out

    def to_host(self, tensor: torch.Tensor, target: memoryview) -> None:
        """Copy `tensor`'s bytes into `target` (a segment's mapping, exactly their size).

        Waits for the current stream to reach the copy: the bytes are there on return.
        """
        nbytes = tensor.numel() * tensor.element_size()
        if len(target) != nbytes:
            raise ValueError(f"target holds {len(target)} bytes, the tensor {nbytes}")

        def write(data: memoryview) -> None:
            target[:] = data

        self.to_file(tensor, write)

    def to_file(self, tensor: torch.Tensor, write: Callable[[memoryview], None]) -> None:
        """Hand `tensor`'s bytes, on the host, to `write` (a segment's `write`): from the
        tensor itself on the CPU, else from pinned staging once the copy is done. Returns
        when `write` has; the staging buffer is then free again."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        source = _bytes_of(tensor.detach().contiguous())
        if not (self.pinned and tensor.is_cuda) or nbytes > self.pool.max_bytes:
            write(source.cpu().numpy().data)  # larger than the pool: a plain copy
            return
        staging = self.pool.take(nbytes)
        try:
            staging[:nbytes].copy_(source, non_blocking=True)
            event = self._recorded()
            assert event is not None
            event.synchronize()
            write(staging[:nbytes].numpy().data)
        finally:
            self.pool.give(staging, None)

    def _recorded(self) -> torch.cuda.Event | None:
        """An event recorded now on the current stream of the device."""
        if not self.pinned:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event
