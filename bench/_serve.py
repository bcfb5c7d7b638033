"""The `moe-control serve` command line the benches start, and its listening line.

Every bench that measures a real server starts it the same way: on loopback, ephemeral
ports, the CPU worker unless told otherwise, one server process unless the bench measures
several, its own flags last (argparse keeps the last of a repeated flag, so a bench or its
caller can override any default here).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

LISTENING = re.compile(r"listening for gRPC on (\S+?)(?:; metrics at (\S+?))?(?:; HTTP at (\S+))?$")
"""The server's first stdout line: group 1 the gRPC address, group 2 the metrics URL (None
with metrics off)."""


def serve_command(
    *flags: str,
    devices: str = "cpu",
    processes: int | None = 1,
    metrics: bool = True,
    prefix: Sequence[str] = (),
) -> list[str]:
    """argv for `moe-control serve` on 127.0.0.1 with ephemeral gRPC, HTTP and metrics ports
    (`metrics=False`: no metrics endpoint), `processes` server processes (None: the
    server's default, one per core), then `flags`; `prefix` runs it under a tool
    (valgrind, py-spy)."""
    command = [
        *prefix, sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
        "--port", "0", *(("--metrics-port", "0") if metrics else ("--no-metrics-enabled",)),
        "--devices", devices, "--http-port", "0",
    ]  # fmt: skip
    if processes is not None:
        command += ["--server-processes", str(processes)]
    return [*command, *flags]


def listening(line: str) -> re.Match[str] | None:
    """The listening line's match (address, metrics URL), or None for any other line."""
    return LISTENING.search(line.strip())
