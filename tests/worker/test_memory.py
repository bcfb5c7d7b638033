"""The worker caps glibc's malloc arenas (service/worker/memory.py), unless told otherwise.

Why: one arena per job thread let the worker's RSS climb for as long as mixed load lasted
(bench/soak.py); the effect itself is what `make soak` measures. Here: the cap is applied
in a fresh process, and an operator's MALLOC_ARENA_MAX is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

CODE = "from service.worker.memory import limit_malloc_arenas; print(limit_malloc_arenas())"


def run(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CODE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_the_cap_is_applied_in_a_glibc_process() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    expected = (
        "True"
        if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION")
        else "False"
    )
    assert run(env) == expected


def test_an_operators_setting_wins() -> None:
    assert run({**os.environ, "MALLOC_ARENA_MAX": "8"}) == "False"
