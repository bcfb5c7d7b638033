"""Replacing a data plane's JSON store on disk whole or not at all.

The measured-timings cache and the observed-decisions store both rewrite one small file
after each change: the text goes to a private temporary file beside it, is synced, then
renamed over it, so a reader (or a restart after a crash) sees the old file or the new one,
never half of either.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, making its directory if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
