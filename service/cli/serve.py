"""`moe-control serve`: the gRPC server, its workers and the /metrics endpoint."""

from __future__ import annotations

import argparse
import os
import sys

from service.client.exits import EXIT_BAD_INPUT
from service.ports import PortTakenError
from service.settings import ENV_PREFIX, Settings, SettingsError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the moe_control.v1 gRPC API and HTTP/JSON (one worker per device, /metrics)",
        description="Serve the moe_control.v1 gRPC API with standard health and reflection "
        "(and the HTTP/JSON API on --http-port, docs/http.md), "
        "one supervised worker process per device and a Prometheus /metrics endpoint. Every "
        f"flag can also be set as an environment variable ({ENV_PREFIX}<FLAG>, e.g. "
        f"{Settings.env_name('port')}); flags win. Prints 'moe-control listening for gRPC "
        "on HOST:PORT' once the port is bound (liveness SERVING), then 'moe-control ready: N "
        "of M workers ready' once a worker can take calls (readiness SERVING); clients wait "
        "for the second with --wait-ready.",
    )
    Settings.add_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from service.server.primary import run as serve

    fields = {k: v for k, v in vars(args).items() if k not in ("handler", "command")}
    try:
        settings = Settings.load(fields, os.environ)
        settings.token()  # a missing token file is a start-up error, not a runtime one
    except SettingsError as exc:
        print(f"moe-control serve: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return serve(settings)
    except PortTakenError as exc:  # a setting's fault, as a bad value is
        print(f"moe-control serve: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
