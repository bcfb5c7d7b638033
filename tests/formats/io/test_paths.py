"""Confinement of client paths to the data root: `..`, absolute escapes, symlink escapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.formats.errors import InvalidPathError, PermissionDeniedError
from service.formats.io.paths import DataRoot


@pytest.fixture
def root(tmp_path: Path) -> DataRoot:
    (tmp_path / "data" / "models").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    return DataRoot.at(tmp_path / "data")


def test_relative_and_absolute_paths_inside_resolve(root: DataRoot) -> None:
    assert root.resolve("models", "f") == root.root / "models"
    assert root.resolve(str(root.root / "models"), "f") == root.root / "models"
    # Not yet existing paths are fine (an output directory).
    assert root.resolve("models/new/out", "f") == root.root / "models" / "new" / "out"
    assert root.resolve(".", "f") == root.root


@pytest.mark.parametrize("path", ["../outside", "models/../../outside", "models/../models", ".."])
def test_dotdot_is_refused(root: DataRoot, path: str) -> None:
    with pytest.raises(PermissionDeniedError) as info:
        root.resolve(path, "checkpoint.input_dir")
    assert info.value.field == "checkpoint.input_dir"
    assert "'..'" in str(info.value)


def test_absolute_escape_is_refused(root: DataRoot, tmp_path: Path) -> None:
    with pytest.raises(PermissionDeniedError, match="outside the data root"):
        root.resolve(str(tmp_path / "outside"), "checkpoint.output_dir")
    with pytest.raises(PermissionDeniedError):
        root.resolve("/etc/passwd", "f")
    # A sibling whose name merely starts with the root's name is outside too.
    sibling = Path(str(root.root) + "-evil")
    sibling.mkdir()
    with pytest.raises(PermissionDeniedError):
        root.resolve(str(sibling), "f")


def test_symlink_escapes_are_refused(root: DataRoot, tmp_path: Path) -> None:
    os.symlink(tmp_path / "outside", root.root / "link")
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        root.resolve("link", "f")
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        root.resolve("link/deeper/file", "f")
    # A link that stays inside is followed.
    os.symlink(root.root / "models", root.root / "inner")
    assert root.resolve("inner", "f") == root.root / "models"


def test_child_names_from_an_index(root: DataRoot) -> None:
    directory = root.root / "models"
    assert root.child(directory, "a.safetensors", "index") == directory / "a.safetensors"
    for bad in ("../a.safetensors", "/etc/passwd", ""):
        with pytest.raises(PermissionDeniedError):
            root.child(directory, bad, "index")


def test_bad_paths_are_invalid_not_denied(root: DataRoot) -> None:
    with pytest.raises(InvalidPathError):
        root.resolve("", "f")
    with pytest.raises(InvalidPathError):
        root.resolve("a\x00b", "f")


def test_check_notices_a_swapped_in_symlink(root: DataRoot, tmp_path: Path) -> None:
    target = root.resolve("models/out", "f")
    root.check(target, "f")
    os.symlink(tmp_path / "outside", target)
    with pytest.raises(PermissionDeniedError):
        root.check(target, "f")


def test_unconfined_allows_everything_absolute(tmp_path: Path) -> None:
    assert DataRoot.unconfined().resolve(str(tmp_path), "f") == Path(os.path.realpath(tmp_path))


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        DataRoot.at(tmp_path / "missing")
