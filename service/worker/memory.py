"""Keep the worker's heap from growing under mixed load: cap glibc's malloc arenas.

Why: every background call (a conversion, a forward) runs on a thread of its own
(`jobs.py`), and glibc gives threads their own malloc arenas, up to 8 per core. Each arena
keeps the memory its thread freed, fragmented, for reuse by whichever thread lands on it
next; with calls of different sizes arriving on fresh threads, the worker's RSS climbed in
steps for as long as the load lasted (bench/soak.py, every RPC at once for 300 s on a
2-core box: 241 -> 473 MiB, still rising), while the same run with two arenas stayed flat
at ~265 MiB with the same throughput. A GPU host has many more cores, so more arenas.

An operator's own `MALLOC_ARENA_MAX` wins (glibc has applied it already); on a C library
without `mallopt` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os

#: glibc's `M_ARENA_MAX` parameter of mallopt(3).
_M_ARENA_MAX = -8
#: The main arena plus one shared by every job thread.
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap the arenas of this process (call it before threads start); True if applied."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))
