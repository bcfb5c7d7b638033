"""The flags every client command shares (where the server is, TLS, the token, --timeout,
--wait-ready) and the `Connection` they describe.

One definition, so `health`, `run`, `convert`, `select` and the listing commands spell and
mean them the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.client.channel import Connection

__all__ = ["add_connection_arguments", "connection_from_args"]


def add_connection_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_timeout: float | None,
    server_default: str | None = None,
    server_help: str = "call a moe-control server at HOST:PORT",
    token: bool = True,
) -> None:
    """--server, --tls-ca, --tls-cert, --tls-key, (--token), --timeout and --wait-ready.

    `default_timeout`: seconds the command may take by default (None: no limit)."""
    parser.add_argument("--server", default=server_default, help=server_help)
    if token:
        parser.add_argument("--token", help="bearer token (default: $MOE_CONTROL_AUTH_TOKEN)")
    parser.add_argument("--tls-ca", type=Path, help="CA bundle to verify the server over TLS")
    parser.add_argument("--tls-cert", type=Path, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, help="private key of --tls-cert")
    shown = "no limit" if default_timeout is None else f"{default_timeout:g}"
    parser.add_argument(
        "--timeout",
        type=float,
        default=default_timeout,
        help=f"seconds the whole command may take, waiting included (default {shown})",
    )
    parser.add_argument(
        "--wait-ready",
        action="store_true",
        help="wait (within --timeout) until the server is ready before calling it",
    )


def connection_from_args(args: argparse.Namespace) -> Connection:
    """The `service.client.channel.Connection` the flags describe (imports grpc)."""
    from service.client.channel import Connection

    return Connection(
        args.server,
        token=getattr(args, "token", None),
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        timeout=args.timeout,
        wait_ready=args.wait_ready,
    )
