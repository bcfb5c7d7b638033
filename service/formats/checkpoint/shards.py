"""The input shards of a whole-checkpoint run, each mapped once for the whole run.

Layers read their tensors from the mapped shards, the copy of the rest reads the same
shards again, and the planner reads their headers: one `SafetensorsFile` per shard serves
all three, opened on first use (confined to the data root) and closed when the run ends.
"""

from __future__ import annotations

from pathlib import Path

from service.formats.io.paths import DataRoot
from service.formats.io.safetensors import SafetensorsFile

__all__ = ["Shards"]


class Shards:
    """The input shards, each mapped once for the whole run."""

    def __init__(self, directory: Path, root: DataRoot) -> None:
        self.directory = directory
        self.root = root
        self._open: dict[str, SafetensorsFile] = {}

    def __getitem__(self, name: str) -> SafetensorsFile:
        file = self._open.get(name)
        if file is None:
            field = f"checkpoint.input_dir/{name}"
            file = SafetensorsFile(self.root.child(self.directory, name, field), field)
            self._open[name] = file
        return file

    def close(self) -> None:
        for file in self._open.values():
            file.close()
        self._open.clear()
