"""A data plane store's file is replaced whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.dataplane.files import replace_file


def test_writes_then_replaces_making_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "state" / "store.json"
    replace_file(path, '{"a": 1}')
    replace_file(path, '{"a": 2}')
    assert path.read_text() == '{"a": 2}'
    assert [p.name for p in path.parent.iterdir()] == ["store.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    replace_file(path, "old")
    with pytest.raises(UnicodeEncodeError):
        replace_file(path, "\udcff")  # a lone surrogate: no encoding writes it
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["store.json"]
