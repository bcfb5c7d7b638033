"""The worker tunes glibc's malloc (service/process.py), unless told otherwise.

Why: with glibc's defaults the worker's heap grew for as long as mixed load lasted
(bench/soak.py); the effect itself is what `make soak` measures. Here: both settings are
applied in a fresh process, and an operator's own environment variable is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.process import (
    ENVIRONMENT,
    RUNTIME_PREFIX,
    SETTINGS,
    make_runtime_dir,
    sweep_runtime_dirs,
)

CODE = "import json; from service.process import tune_malloc; print(json.dumps(tune_malloc()))"
GLIBC = sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
NAMES = [ENVIRONMENT[parameter] for parameter in SETTINGS["worker"]]


def applied(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", CODE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: list[str] = json.loads(done.stdout)
    return result


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_both_settings_are_applied() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT.values()}
    assert applied(env) == NAMES


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_an_operators_setting_wins() -> None:
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    assert applied({**env, "MALLOC_ARENA_MAX": "8"}) == ["MALLOC_MMAP_THRESHOLD_"]


def test_runtime_dirs_of_dead_servers_are_swept(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    dead = tmp_path / f"{RUNTIME_PREFIX}{int(gone.stdout)}-abc"
    (dead / "metrics").mkdir(parents=True)
    alive = tmp_path / f"{RUNTIME_PREFIX}{os.getpid()}-def"
    alive.mkdir()
    other = tmp_path / "moe-control-segments-xyz"
    other.mkdir()
    assert sweep_runtime_dirs(str(tmp_path)) == [str(dead)]
    fresh = Path(make_runtime_dir(str(tmp_path)))
    assert fresh.name.startswith(f"{RUNTIME_PREFIX}{os.getpid()}-")
    assert oct(fresh.stat().st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [alive.name, other.name, fresh.name]
    )
