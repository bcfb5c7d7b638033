"""Confinement of user-given paths to a configured data root.

A path-mode conversion reads and writes files named by the client, on a volume the server
can reach. The server must never become a way to read `/etc/shadow` or overwrite its own
code, so every path is resolved against one data root and refused when it could leave it:
a `..` component (refused outright, even when it would stay inside: it is never needed and
makes reviews of logs harder), an absolute path elsewhere, or a symbolic link (anywhere on
the way) that resolves outside. Refusals are `PermissionDeniedError`, which the API maps to
PERMISSION_DENIED naming the request field.

Files created later are opened with `O_NOFOLLOW` and re-checked before they are renamed into
place (`DataRoot.check`), which narrows the window in which a symlink swapped in after the
check could redirect a write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from service.formats.errors import InvalidPathError, PermissionDeniedError


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True, slots=True)
class DataRoot:
    """The one directory tree path-mode conversions may touch; `root` is a real path."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> DataRoot:
        """The root at `path` (resolved once; it must be an existing directory)."""
        real = Path(os.path.realpath(path))
        if not real.is_dir():
            raise FileNotFoundError(f"data root {str(path)!r} is not a directory")
        return cls(real)

    @classmethod
    def unconfined(cls) -> DataRoot:
        """The whole file system: the local CLI acts for its own user, with their rights."""
        return cls(Path(os.sep))

    def resolve(self, path: str | os.PathLike[str], field: str) -> Path:
        """The real path of `path` (relative paths are taken from the root) after checking
        that it stays inside the root. The path need not exist yet: the part that exists
        is resolved through its symlinks, the rest is appended as written."""
        text = os.fspath(path)
        if not text:
            raise InvalidPathError(field, "required: a path")
        if "\x00" in text:
            raise InvalidPathError(field, "a path must not contain a NUL byte")
        if ".." in PurePosixPath(text).parts:
            raise PermissionDeniedError(field, text, "'..' components are not allowed")
        candidate = os.path.normpath(os.path.join(self.root, text))
        root = str(self.root)
        if not _inside(candidate, root):
            raise PermissionDeniedError(field, text, f"outside the data root {root}")
        real = os.path.realpath(candidate)
        if not _inside(real, root):
            raise PermissionDeniedError(
                field, text, "a symbolic link on the way leads outside the data root"
            )
        return Path(real)

    def child(self, directory: Path, name: str, field: str) -> Path:
        """A file named inside a checkpoint (an index's shard name): relative, without
        `..`, and inside the root after symlinks. A symlink may lead out of `directory`
        itself: the Hugging Face cache links snapshot files to `../../blobs/`."""
        if not name or os.path.isabs(name) or ".." in PurePosixPath(name).parts:
            raise PermissionDeniedError(
                field, name, f"must be a relative name inside {directory} without '..'"
            )
        return self.resolve(directory / name, field)

    def check(self, path: Path, field: str) -> None:
        """Re-check an already resolved path just before it is used for a write."""
        real = os.path.realpath(path)
        if not _inside(real, str(self.root)):
            raise PermissionDeniedError(field, str(path), "now leads outside the data root")

    def contains(self, path: str | os.PathLike[str]) -> bool:
        return _inside(os.path.realpath(path), str(self.root))
