"""Keep the worker's heap from growing under mixed load: two glibc malloc settings.

Why, as bench/soak.py measured it (every RPC at once for 300 s on a 2-core box):

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

An operator's own `MALLOC_ARENA_MAX` / `MALLOC_MMAP_THRESHOLD_` wins (glibc has applied it
already); on a C library without `mallopt` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os

#: mallopt(3) parameter -> (the environment variable that sets it too, our value).
SETTINGS: dict[int, tuple[str, int]] = {
    -8: ("MALLOC_ARENA_MAX", 2),  # M_ARENA_MAX: the main arena plus one for job threads
    -3: ("MALLOC_MMAP_THRESHOLD_", 4 << 20),  # M_MMAP_THRESHOLD: fixed, never raised
}


def tune_malloc() -> list[str]:
    """Apply SETTINGS to this process (call it before threads start); returns the names of
    those applied."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return []
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return [
        name
        for parameter, (name, value) in SETTINGS.items()
        if name not in os.environ and mallopt(parameter, value)
    ]
