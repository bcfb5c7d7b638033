"""The server process applies process.py's "server" row of malloc settings at start.

Why: at M = 4096 a RunMoE moves 8+ MiB each way through fresh buffers in this process;
under glibc's default thresholds each was mapped (or the heap grown), faulted in, zeroed and
given back per call (bench/RESULTS.md). Checked by the effect, in a fresh process that goes
through `service.server.primary.run` (stopped at once by a busy metrics port): a block between the
default and our mmap threshold comes from the heap, not a mapping of its own, and once
freed the heap keeps it rather than trimming it. An operator's MALLOC_* variable wins, and
`--no-malloc-tuning` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from service.process import ENVIRONMENT, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, SETTINGS

# 48 MiB: above glibc's highest dynamic mmap threshold (32 MiB), so without our setting it
# is always a mapping of its own; and below the server's mmap threshold.
BLOCK = 48 << 20
CODE = f"""
import ctypes, json, socket, sys
from service.ports import PortTakenError
from service.server.primary import run as serve
from service.settings import Settings

def run(settings):
    try:
        return serve(settings)
    except PortTakenError:  # the busy port, named: `moe-control serve` exits 2
        return 2

busy = socket.socket()
busy.bind(("127.0.0.1", 0))
busy.listen()
code = run(Settings(port=0, http_port=0, metrics_port=busy.getsockname()[1], devices="cpu",
                    log_level="ERROR", malloc_tuning=sys.argv[1] == "on"))

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
mapped = mallinfo2().hblks
block = bytearray({BLOCK})
mapped = mallinfo2().hblks - mapped
del block
print(json.dumps({{"code": code, "mapped": mapped, "kept": mallinfo2().keepcost}}))
"""
HAS_MALLINFO2 = hasattr(ctypes.CDLL(None), "mallinfo2")


# A replica (`--server-processes` > 1) through its own start, `service.server.replica._serve`,
# stopped at once by a busy port: the same measurement after it.
REPLICA_CODE = CODE.replace(
    """code = run(Settings(port=0, http_port=0, metrics_port=busy.getsockname()[1], devices="cpu",
                    log_level="ERROR", malloc_tuning=sys.argv[1] == "on"))""",
    """import asyncio, os, tempfile
from service.server.replica import _serve
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
config = {"settings": {"malloc_tuning": sys.argv[1] == "on", "devices": "cpu"},
          "port": busy.getsockname()[1], "internal": "127.0.0.1:1"}
code = asyncio.run(_serve(config, asyncio.StreamReader()))""",
)


def started(extra_env: dict[str, str], tuning: str = "on", code: str = CODE) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT.values()}
    done = subprocess.run(
        [sys.executable, "-c", code, tuning],
        env={**env, **extra_env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    # The busy port stopped it at start: the server names it (exit 2, a setting's fault);
    # a replica, told its port by the primary, reports that it failed (1).
    assert result["code"] == (2 if code == CODE else 1), done.stderr
    return result


def test_the_server_row_holds_the_block() -> None:
    row = SETTINGS["server"]
    assert row[M_MMAP_THRESHOLD] > BLOCK
    assert row[M_TRIM_THRESHOLD] > BLOCK


@pytest.mark.skipif(not HAS_MALLINFO2, reason="mallinfo2 is glibc's (2.33+)")
def test_the_server_applies_its_row_at_start() -> None:
    result = started({})
    assert result["mapped"] == 0  # from the heap: the mmap threshold is ours
    assert result["kept"] >= BLOCK  # not trimmed once freed: the trim threshold is ours


@pytest.mark.skipif(not HAS_MALLINFO2, reason="mallinfo2 is glibc's (2.33+)")
def test_an_operators_variable_wins_in_the_server() -> None:
    result = started({ENVIRONMENT[M_TRIM_THRESHOLD]: str(128 << 10)})
    assert result["mapped"] == 0  # our mmap threshold still applied
    assert result["kept"] < BLOCK  # the operator's trim threshold: the freed block went back


@pytest.mark.skipif(not HAS_MALLINFO2, reason="mallinfo2 is glibc's (2.33+)")
def test_no_malloc_tuning_leaves_glibcs_defaults() -> None:
    result = started({}, tuning="off")
    assert result["mapped"] == 1  # a mapping of its own
    assert result["kept"] < BLOCK  # and nothing of it kept


@pytest.mark.skipif(not HAS_MALLINFO2, reason="mallinfo2 is glibc's (2.33+)")
@pytest.mark.parametrize(("tuning", "mapped"), [("on", 0), ("off", 1)])
def test_a_replica_applies_the_same_row(tuning: str, mapped: int) -> None:
    assert REPLICA_CODE != CODE
    result = started({}, tuning=tuning, code=REPLICA_CODE)
    assert result["mapped"] == mapped
    assert (result["kept"] >= BLOCK) is (tuning == "on")
