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

__all__ = ["BadFlagError", "add_connection_arguments", "connection_from_args", "server_address"]


class BadFlagError(ValueError):
    """A flag the command cannot use, named in the message (exit 2, nothing was sent)."""


def server_address(server: str, *, tls: bool) -> str:
    """--server as grpc dials it: HOST:PORT as given, or a URL's HOST:PORT. `http://`
    means plaintext and `https://` TLS, so each must agree with the TLS flags (--tls-ca
    turns TLS on); any other scheme, or a path after the port, is refused."""
    if "://" not in server:
        return server
    scheme, _, rest = server.partition("://")
    scheme = scheme.lower()
    if scheme not in ("http", "https"):
        raise BadFlagError(f"--server {server}: HOST:PORT, http://HOST:PORT or https://HOST:PORT")
    host = rest.rstrip("/")
    if not host or "/" in host:
        raise BadFlagError(f"--server {server}: no path after HOST:PORT (the API has none)")
    if scheme == "https" and not tls:
        raise BadFlagError(f"--server {server}: https needs --tls-ca (the CA that signed it)")
    if scheme == "http" and tls:
        raise BadFlagError(f"--server {server}: http is plaintext but --tls-ca asks for TLS")
    return host


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

    address: str = args.server
    if isinstance(address, str):
        address = server_address(address, tls=args.tls_ca is not None)
    return Connection(
        address,
        token=getattr(args, "token", None),
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        timeout=args.timeout,
        wait_ready=args.wait_ready,
    )
