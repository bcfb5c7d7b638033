"""Our mmap reader and streaming atomic writer against the safetensors package itself."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.formats.errors import ConvertInputError
from service.formats.io.safetensors import (
    HASH_AHEAD,
    HASH_IN_THREAD,
    WRITE_SLICE,
    SafetensorsFile,
    SafetensorsWriter,
    atomic_write_bytes,
    hash_file,
    hash_tensors,
    plan_of,
    tensor_bytes,
)


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.qweight": torch.randint(-(2**31), 2**31 - 1, (16, 8), dtype=torch.int32, generator=g),
        "a.scales": torch.randn(2, 8, generator=g).to(torch.float16),
        "b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.float32),
    }


def test_reads_what_safetensors_writes(tmp_path: Path) -> None:
    tensors = sample()
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "x.safetensors") as file:
        assert file.metadata == {"format": "pt"}
        assert set(file.entries) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(file.tensor(name), tensor)
            assert bytes(file.raw(name)) == bytes(tensor_bytes(tensor))


def test_safetensors_reads_what_we_write(tmp_path: Path) -> None:
    tensors = sample()
    path = tmp_path / "y.safetensors"
    with SafetensorsWriter(path, [plan_of(n, t) for n, t in tensors.items()], {"k": "v"}) as w:
        for name, tensor in tensors.items():
            w.write(name, tensor_bytes(tensor))
        w.commit()
    assert w.sha256 == {
        name: hashlib.sha256(bytes(tensor_bytes(tensor))).hexdigest()
        for name, tensor in tensors.items()
    }
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
    assert hash_tensors(path) == w.sha256
    assert [p.name for p in tmp_path.iterdir()] == ["y.safetensors"]


def large() -> dict[str, torch.Tensor]:
    """Tensors past HASH_IN_THREAD (hashed by helper threads while the writer goes on),
    mixed with small ones (hashed inline), one of them not contiguous."""
    g = torch.Generator().manual_seed(1)
    words = HASH_IN_THREAD // 4
    return {
        "w13": torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g),
        "s": torch.randn(7, 9, generator=g).to(torch.float16),
        "w2": torch.randint(0, 255, (words, 5), dtype=torch.uint8, generator=g).t(),
        "tail": torch.randint(0, 255, (HASH_IN_THREAD + 3,), dtype=torch.uint8, generator=g),
    }


def test_large_tensors_hash_beside_the_writes(tmp_path: Path) -> None:
    """Each digest is the tensor's own (none swapped between threads), files from several
    writers at once included, and every one equals a re-read of the written file."""
    sets = [large(), sample(), large()]
    writers = []
    for number, tensors in enumerate(sets):
        path = tmp_path / f"l{number}.safetensors"
        writers.append(SafetensorsWriter(path, [plan_of(n, t) for n, t in tensors.items()]))
    for tensors, writer in zip(sets, writers, strict=True):
        for name, tensor in tensors.items():
            writer.write(name, tensor_bytes(tensor))
    for tensors, writer in zip(sets, writers, strict=True):
        writer.commit()
        assert writer.sha256 == {
            name: hashlib.sha256(bytes(tensor_bytes(tensor))).hexdigest()
            for name, tensor in tensors.items()
        }
        assert list(writer.sha256) == list(tensors)
        assert hash_tensors(writer.path) == writer.sha256
        loaded = load_file(writer.path)
        assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_an_aborted_write_with_hashes_in_flight_leaves_nothing(tmp_path: Path) -> None:
    tensors = large()
    plans = [plan_of(n, t) for n, t in tensors.items()]
    with pytest.raises(RuntimeError), SafetensorsWriter(tmp_path / "x.safetensors", plans) as w:
        for name in ("w13", "s", "w2"):
            w.write(name, tensor_bytes(tensors[name]))
        raise RuntimeError("cancelled")
    assert list(tmp_path.iterdir()) == []
    assert w.sha256 == {}


def test_hash_file_is_the_files_sha256(tmp_path: Path) -> None:
    """Hashed from a mapping in WRITE_SLICE steps, read ahead by HASH_AHEAD: sizes around
    both, and an empty file."""
    block = os.urandom(4096 + 13)
    sizes = (0, 1, WRITE_SLICE - 1, WRITE_SLICE, 2 * WRITE_SLICE + 5, HASH_AHEAD + 7)
    for size in sizes:
        data = (block * (size // len(block) + 1))[:size]
        path = tmp_path / f"f{size}"
        path.write_bytes(data)
        assert hash_file(path) == hashlib.sha256(data).hexdigest(), size


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs procfs")
def test_hash_file_reads_what_cannot_be_sized() -> None:
    """procfs files say size 0 and have content: hashed as read, not as empty."""
    path = Path("/proc/version")
    assert hash_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert hash_file(path) != hashlib.sha256(b"").hexdigest()


def test_an_aborted_write_leaves_nothing(tmp_path: Path) -> None:
    tensors = sample()
    path = tmp_path / "z.safetensors"
    plans = [plan_of(n, t) for n, t in tensors.items()]
    with pytest.raises(RuntimeError), SafetensorsWriter(path, plans) as w:
        w.write("a.qweight", tensor_bytes(tensors["a.qweight"]))
        raise RuntimeError("cancelled")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_out_of_plan_data(tmp_path: Path) -> None:
    tensors = sample()
    with SafetensorsWriter(
        tmp_path / "p.safetensors", [plan_of(n, t) for n, t in tensors.items()]
    ) as w:
        with pytest.raises(ValueError, match=r"expected a\.qweight"):
            w.write("a.scales", tensor_bytes(tensors["a.scales"]))
        with pytest.raises(ValueError, match="not written"):
            w.commit()
        w.abort()
    assert list(tmp_path.iterdir()) == []


def corrupt(tmp_path: Path, header: object, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"", "out of the file"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "another size"),
        ({"t": {"dtype": "F32", "shape": "x", "data_offsets": [0, 8]}}, bytes(8), "shape"),
        ([1, 2], b"", "JSON object"),
    ],
)
def test_malformed_files_are_format_errors(
    tmp_path: Path, header: object, data: bytes, match: str
) -> None:
    with pytest.raises(ConvertInputError, match=match):
        SafetensorsFile(corrupt(tmp_path, header, data), "shard")


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x10\x00")
    with pytest.raises(ConvertInputError, match="shorter than 8"):
        SafetensorsFile(path)
    path.write_bytes((10**12).to_bytes(8, "little"))
    with pytest.raises(ConvertInputError, match="header"):
        SafetensorsFile(path)


def test_unknown_dtypes_copy_as_bytes(tmp_path: Path) -> None:
    path = corrupt(
        tmp_path, {"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"8bytes!!"
    )
    with SafetensorsFile(path) as file:
        assert bytes(file.raw("t")) == b"8bytes!!"


def test_atomic_small_file(tmp_path: Path) -> None:
    atomic_write_bytes(tmp_path / "m.json", b"{}")
    atomic_write_bytes(tmp_path / "m.json", b'{"a": 1}')
    assert (tmp_path / "m.json").read_bytes() == b'{"a": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
