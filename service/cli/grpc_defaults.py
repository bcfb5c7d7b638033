"""gRPC core's process-wide switches, set before grpc is first imported.

gRPC reads `GRPC_EXPERIMENTS` once, when the `grpc` module loads. grpcio 1.84 routes every
socket through EventEngine's own threads, so a unary call is handed between ~16 threads'
wake-ups in the server and ~8 in the client; turning the three EventEngine endpoint
experiments off puts the sockets back on the thread that polls the completion queue, which
makes a small unary call measurably faster (bench/RESULTS.md, "RunMoE at M = 1: the gRPC
floor and the worker's stages"); every API, integration and TLS test passes either way.

An operator's own `GRPC_EXPERIMENTS` (even an empty one) wins, and nothing is changed once
grpc has been imported (it would no longer be read). A later grpcio that drops these
experiments logs one line about an unknown name and runs on its defaults.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["GRPC_EXPERIMENTS_DEFAULT", "apply"]

GRPC_EXPERIMENTS_DEFAULT = (
    "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"
)
"""The experiments turned off (a leading '-' disables one) unless the environment says
otherwise."""


def apply(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set `GRPC_EXPERIMENTS` to our default when it is unset and grpc is not loaded yet;
    True when it was set. Child processes (server replicas, workers) inherit it."""
    env = os.environ if environ is None else environ
    if "grpc" in sys.modules or "GRPC_EXPERIMENTS" in env:
        return False
    env["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS_DEFAULT
    return True
