"""safetensors files read through mmap and written tensor by tensor, atomically.

The `safetensors` package loads or saves whole dicts of tensors; a multi-GB shard would
then sit in memory twice. Its format is simple (8-byte little-endian header length, a JSON
header of dtype, shape and byte offsets, then the raw data), so we read it through a
private memory map (nothing is loaded until touched, unknown dtypes are copied as bytes)
and write it by declaring every tensor first and streaming the data after, hashing on the
way. A written file appears under its name only complete and fsynced (temp file + fsync +
rename + directory fsync); an aborted one leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import secrets
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from service.formats.errors import ConvertInputError

if TYPE_CHECKING:
    import torch

#: Element size of every safetensors dtype code we know; others are copied as raw bytes.
ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
TORCH_DTYPE = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}
SAFETENSORS_OF_TORCH = {v: k for k, v in TORCH_DTYPE.items()}
#: A header larger than this is refused (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
_ALIGN = 8
#: Data is written and hashed in slices of this size.
WRITE_SLICE = 16 * 1024 * 1024
#: A tensor at least this large is hashed by a helper thread while the writer goes on.
HASH_IN_THREAD = 1024 * 1024
#: How far ahead of its hash `hash_file` asks the kernel to read (a multiple of the page).
HASH_AHEAD = 4 * WRITE_SLICE


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class SafetensorsFile:
    """A safetensors file, mapped; tensors are views into the mapping (copy-on-write, so
    torch accepts them without warnings and nothing is ever written back)."""

    def __init__(self, path: Path, field: str = "") -> None:
        self.path = path
        field = field or str(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise ConvertInputError(field, "not a safetensors file (shorter than 8 bytes)")
            header_len = int.from_bytes(head, "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise ConvertInputError(
                    field, f"not a safetensors file (header of {header_len} bytes)"
                )
            try:
                header = json.loads(os.pread(fd, header_len, 8))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ConvertInputError(field, f"safetensors header is not JSON: {exc}") from None
            if not isinstance(header, dict):
                raise ConvertInputError(field, "safetensors header is not a JSON object")
            base = 8 + header_len
            self.metadata: dict[str, str] = dict(header.pop("__metadata__", None) or {})
            self.entries: dict[str, Entry] = {}
            for name, info in header.items():
                self.entries[name] = _entry(name, info, base, size, field)
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        finally:
            os.close(fd)
        self.size = size

    def raw(self, name: str) -> memoryview:
        entry = self.entries[name]
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[entry.start : entry.end]

    def prefetch(self, names: Iterable[str]) -> None:
        """Ask the kernel to start reading these tensors now (MADV_WILLNEED): a cold
        checkpoint is then read ahead of the conversion in large requests, not page fault
        by page fault."""
        if self._map is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        page = mmap.PAGESIZE
        for name in names:
            entry = self.entries.get(name)
            if entry is None or entry.nbytes == 0:
                continue
            start = entry.start - entry.start % page
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(mmap.MADV_WILLNEED, start, entry.end - start)

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy view of a tensor with a known dtype."""
        import torch

        entry = self.entries[name]
        dtype = getattr(torch, TORCH_DTYPE[entry.dtype])
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        flat = torch.frombuffer(self.raw(name), dtype=torch.uint8)
        return flat.view(dtype).reshape(entry.shape)

    def close(self) -> None:
        if self._map is not None:
            # A tensor view still alive keeps the mapping; it goes when the view does.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _entry(name: str, info: Any, base: int, size: int, field: str) -> Entry:
    where = f"{field}: tensor {name!r}"
    if not isinstance(info, dict):
        raise ConvertInputError(field, f"tensor {name!r} has no dtype/shape/data_offsets object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise ConvertInputError(field, f"tensor {name!r}: dtype must be a string")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ConvertInputError(field, f"tensor {name!r}: shape must be a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
        or base + offsets[1] > size
    ):
        raise ConvertInputError(field, f"tensor {name!r}: data_offsets out of the file")
    start, end = base + offsets[0], base + offsets[1]
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is not None and end - start != math.prod(shape) * itemsize:
        raise ConvertInputError(
            field, f"{where} holds {end - start} bytes, but {dtype} {shape} needs another size"
        )
    return Entry(name, dtype, tuple(shape), start, end)


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """A tensor to be written: declared before any data."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    nbytes: int


def plan_of(name: str, tensor: torch.Tensor) -> TensorPlan:
    code = SAFETENSORS_OF_TORCH[str(tensor.dtype).removeprefix("torch.")]
    return TensorPlan(name, code, tuple(tensor.shape), tensor.numel() * tensor.element_size())


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (copied only if not contiguous)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write a small file atomically (temp + fsync + rename + directory fsync). Without
    `durable` the fsyncs are skipped: the file still appears whole or not at all, but a
    power cut may lose it (right for records that can be rebuilt)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def sha256_of(data: memoryview) -> str:
    digest = hashlib.sha256()
    for offset in range(0, len(data), WRITE_SLICE):
        digest.update(data[offset : offset + WRITE_SLICE])
    return digest.hexdigest()


_HASHERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sha256")


class SafetensorsWriter:
    """Writes one safetensors file: the header from `plans`, then each tensor's data in
    plan order. `commit()` makes it appear; leaving the `with` block by an exception (or
    `abort()`) removes the temp file. Every tensor's SHA-256 is computed on the way."""

    def __init__(
        self, path: Path, plans: Iterable[TensorPlan], metadata: dict[str, str] | None = None
    ) -> None:
        self.path = path
        self.plans = list(plans)
        #: name -> SHA-256 of its data, for every tensor, once `commit()` has returned.
        self.sha256: dict[str, str] = {}
        self._digests: list[tuple[str, str | Future[str]]] = []
        self._next = 0
        self._done = False
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for plan in self.plans:
            header[plan.name] = {
                "dtype": plan.dtype,
                "shape": list(plan.shape),
                "data_offsets": [offset, offset + plan.nbytes],
            }
            offset += plan.nbytes
        self.data_bytes = offset
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % _ALIGN)
        self.temp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        self._fd = os.open(
            self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            self._write(len(text).to_bytes(8, "little") + text)
        except BaseException:
            self.abort()
            raise
        self.total_bytes = 8 + len(text) + offset

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def write(self, name: str, data: bytes | memoryview) -> None:
        """Write the next tensor's bytes. Its SHA-256 is computed by a hashing thread while
        this one goes on writing (this tensor and the next ones) and is in `sha256` once
        `commit()` returns; so `data` must not change until then (it is only read, never
        copied: the caller's tensors and mappings stay alive that long anyway)."""
        if self._next >= len(self.plans):
            raise ValueError(f"{name}: every planned tensor is already written")
        plan = self.plans[self._next]
        view = memoryview(data).cast("B")
        if plan.name != name or len(view) != plan.nbytes:
            raise ValueError(
                f"expected {plan.name} ({plan.nbytes} bytes), got {name} ({len(view)} bytes)"
            )
        # hashlib and os.write both release the GIL: with the hash of each large tensor in
        # a helper thread and no wait for it here, a layer costs max(hash, write) rather
        # than their sum, and the last hash overlaps the fsync (commit).
        if len(view) >= HASH_IN_THREAD:
            self._digests.append((name, _HASHERS.submit(sha256_of, view)))
        else:
            self._digests.append((name, sha256_of(view)))
        for offset in range(0, len(view), WRITE_SLICE):
            self._write(view[offset : offset + WRITE_SLICE])
        self._next += 1

    def commit(self) -> None:
        """fsync (while the last hashes finish), collect every tensor's SHA-256 into
        `sha256`, then rename the file into place. A failed hash fails the commit."""
        if self._next != len(self.plans):
            raise ValueError(f"{len(self.plans) - self._next} planned tensors were not written")
        try:
            os.fsync(self._fd)
            for name, digest in self._digests:
                self.sha256[name] = digest if isinstance(digest, str) else digest.result()
        finally:
            os.close(self._fd)
            self._fd = -1
        try:
            os.replace(self.temp, self.path)
        except BaseException:
            self.temp.unlink(missing_ok=True)
            raise
        self._done = True
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self._done:
            return
        for _, digest in self._digests:
            if not isinstance(digest, str):
                digest.cancel()  # a hash already running finishes on its own
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.temp.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is not None:
            self.abort()


def hash_tensors(path: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """SHA-256 of each tensor's data in a safetensors file (all of them by default)."""
    with SafetensorsFile(path) as file:
        wanted = list(file.entries) if names is None else list(names)
        out: dict[str, str] = {}
        for name in wanted:
            if name not in file.entries:
                continue
            view = file.raw(name)
            out[name] = sha256_of(view)
            del view
        return out


def hash_file(path: Path) -> str:
    """SHA-256 of a file's bytes, hashed straight from a read-only mapping of it, the
    kernel asked to read HASH_AHEAD bytes ahead of the hash. No copy into a buffer: a
    read() into a buffer costs several times the system time of the mapping, and slows
    the writes running beside it (the figures are in bench/RESULTS.md). Source shards are
    mapped by the conversion as well, so a file cut short while it is read fails the same
    way either way. A file that cannot be mapped, or whose size says 0 (procfs), is read in
    blocks instead."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        mapping = None
        if size > 0:
            with contextlib.suppress(OSError, ValueError):
                mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        if mapping is None:
            return _hash_stream(fd)
    finally:
        os.close(fd)
    digest = hashlib.sha256()
    try:
        _will_need(mapping, 0, HASH_AHEAD)
        with memoryview(mapping) as view:
            for offset in range(0, size, WRITE_SLICE):
                _will_need(mapping, offset + HASH_AHEAD, WRITE_SLICE)
                digest.update(view[offset : offset + WRITE_SLICE])
    finally:
        mapping.close()
    return digest.hexdigest()


def _hash_stream(fd: int) -> str:
    """SHA-256 of what `fd` reads from its current position to its end."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    while count := os.readv(fd, [buffer]):
        digest.update(view[:count])
    return digest.hexdigest()


def _will_need(mapping: mmap.mmap, start: int, length: int) -> None:
    """Start reading [start, start + length) of a mapping (`start` page-aligned)."""
    length = min(length, len(mapping) - start)
    if length > 0 and hasattr(mmap, "MADV_WILLNEED"):
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_WILLNEED, start, length)
