"""glibc malloc settings per process role: the worker's heap kept from growing under mixed
load, the server's big message buffers kept for the next call.

The worker ("worker" row), as bench/soak.py measured it (every RPC at once for 300 s on a
2-core box):

- Arenas. Every background call (a conversion, a forward) runs on a thread of its own
  (`jobs.py`), and glibc gives threads their own malloc arenas, up to 8 per core, each
  keeping the memory its thread freed, fragmented. The worker's RSS climbed in steps for as
  long as the load lasted (241 -> 473 MiB, still rising); with two arenas it stayed flat at
  the same throughput. A GPU host has more cores, so more arenas.
- The mmap threshold. glibc serves a large block with mmap and returns it on free, but
  after each such free it raises the threshold to that block's size (up to 32 MiB), so
  later tensors of that size come from the heap, where they fragment and stay. Fixing the
  threshold turns the raising off. At glibc's initial 128 KiB the worker's anonymous RSS
  stayed within 2 % over the soak instead of wandering between 157 and 216 MiB with a
  rising floor, but every intermediate tensor of a CPU forward became an mmap + page faults
  + munmap: EMULATION at M = 1 went from 1.4 to 7.3 ms, at M = 256 from 27 to 63 ms
  (bench/runmoe_overhead.py --shape small, OMP_NUM_THREADS=1). At 4 MiB the forward is back
  at 1.6 / 27 ms, and the blocks that fragment worst (layer-sized tensors, segments) are
  still mapped and returned whole.

The server process (`service/server.py` applies the "server" row at start) has the opposite
problem. A RunMoE at M = 4096 moves 8 MiB each way through fresh buffers there (the
request's bytes, the output read from its segment, the message, the serialized reply,
grpc's slices); under glibc's dynamic thresholds each was mapped or taken from a grown
heap, faulted in, zeroed, and unmapped or trimmed away again, on every call. A fixed 64 MiB
mmap threshold keeps a message's buffers on the heap (a bigger block is still mapped and
returned whole), and a 256 MiB trim threshold keeps one call's freed buffers for the next:
server - device 19.8 -> 9.6 ms, client wall - device 51 -> 34 ms at M = 4096 (8.5 MB each
way, bench/runmoe_overhead.py --shape small; bench/RESULTS.md). A 64 MiB trim threshold
kept only part of that, 32 MiB none. The cost is memory kept: the server's anonymous RSS
after big calls is 35-50 MiB higher (92 -> 144 MiB after 50 calls here) and stays there
when idle; a free top of heap beyond the trim threshold still goes back.

An operator's own `MALLOC_*` variable wins (glibc has applied it already); on a C library
without `mallopt` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os
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
