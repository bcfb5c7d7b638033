"""Process set-up that every moe-control process shares: glibc malloc tuned per role, the
start-up heap moved out of the collector's way, and the server's private runtime
directories.

malloc, per role (`tune_malloc`; the measurements are in bench/RESULTS.md):

- The worker ("worker" row). Every background call runs on a thread of its own, and glibc
  gives threads their own arenas (up to 8 per core), each keeping what its thread freed,
  fragmented: the worker's RSS climbed for as long as mixed load lasted. Two arenas keep it
  flat at the same throughput. glibc also raises its mmap threshold after each large free,
  so later tensors of that size come from the heap, where they fragment and stay; a fixed
  threshold turns that off. At glibc's initial 128 KiB every intermediate tensor of a CPU
  forward became an mmap, page faults and a munmap; 4 MiB keeps the forward's speed while
  the blocks that fragment worst (layer-sized tensors, segments) are still mapped and
  returned whole.
- The server processes ("server" row) have the opposite problem: a big RunMoE moves
  megabytes each way through fresh buffers (the request, the output, the message, the
  serialized reply), and under glibc's dynamic thresholds each was mapped or grown, faulted
  in, zeroed and given back on every call. A fixed 64 MiB mmap threshold keeps a message's
  buffers on the heap, and a 256 MiB trim threshold keeps one call's freed buffers for the
  next. The cost is memory kept after big calls, also when idle.

An operator's own `MALLOC_*` variable wins (glibc has applied it already); on a C library
without `mallopt` (musl, macOS) nothing is done.

`settle_heap` runs once a server process has started: what start-up allocated lives as long
as the process, and without it every full collection walks it all, a pause of the event loop
every few thousand requests.

The runtime directories (`make_runtime_dir`) hold a server's private Unix socket and
multiprocess metrics files; a server that was killed could not remove its own, so those of
dead servers are swept when the next one starts.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

Role = Literal["worker", "server"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt(3) parameters

#: mallopt parameter -> the environment variable glibc reads for it (an operator's own).
ENVIRONMENT: dict[int, str] = {
    M_ARENA_MAX: "MALLOC_ARENA_MAX",
    M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_",
    M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_",
}

#: process role -> mallopt parameter -> our value.
SETTINGS: dict[Role, dict[int, int]] = {
    "worker": {
        M_ARENA_MAX: 2,  # the main arena plus one for job threads
        M_MMAP_THRESHOLD: 4 << 20,  # fixed, never raised
    },
    "server": {
        M_MMAP_THRESHOLD: 64 << 20,  # a message's buffers from the heap; bigger ones mapped
        M_TRIM_THRESHOLD: 256 << 20,  # a call's freed buffers stay for the next call
    },
}


def tune_malloc(role: Role = "worker") -> list[str]:
    """Apply `role`'s SETTINGS to this process (call it before threads start); returns the
    environment names of those applied."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return []
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return [
        ENVIRONMENT[parameter]
        for parameter, value in SETTINGS[role].items()
        if ENVIRONMENT[parameter] not in os.environ and mallopt(parameter, value)
    ]


def settle_heap() -> None:
    """Move everything allocated during start-up (modules, descriptors, oracle tables: tens
    of thousands of objects that live as long as the process) out of the collector's way.
    Frozen objects are never collected, so this runs once, after start-up's garbage is
    gone."""
    gc.collect()
    gc.freeze()


#: The private runtime directories (Unix socket, multiprocess metrics) are named
#: moe-control-run-<pid of the primary>-<random>.
RUNTIME_PREFIX = "moe-control-run-"


def make_runtime_dir(base: str | None = None) -> str:
    """A private (0700) directory for this server's socket and metrics files. A server that
    was killed (SIGKILL, OOM) could not remove its own, so those of dead servers are swept
    first."""
    sweep_runtime_dirs(base)
    return tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.getpid()}-", dir=base)


def sweep_runtime_dirs(base: str | None = None) -> list[str]:
    """Remove the runtime directories whose server process is gone; returns them."""
    removed = []
    for path in Path(base or tempfile.gettempdir()).glob(RUNTIME_PREFIX + "*"):
        pid = path.name[len(RUNTIME_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)) or path.stat().st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
