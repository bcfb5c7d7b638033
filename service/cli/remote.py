"""What the inventory commands (`presets`, `workers`, `layers`, `unload`) share beyond the
client flags (`client_flags`): `--json`, the connection from the flags, and how a failed
call is told and which exit status it gives.

grpc is imported only when a command calls a server, so `presets` stays a local tool.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from service.cli.client_flags import add_connection_arguments, connection_from_args
from service.client.exits import (
    EXIT_BAD_INPUT,
    EXIT_NOT_FOUND,
    EXIT_NOT_READY,
    EXIT_SERVER_ERROR,
)

if TYPE_CHECKING:
    from service.client.channel import Connection

DEFAULT_SERVER = "localhost:50151"
DEFAULT_TIMEOUT_S = 10.0


def add_flags(parser: argparse.ArgumentParser, *, server_default: str | None) -> None:
    """The client flags (--server, --token, --tls-*, --timeout, --wait-ready) and --json."""
    where = f"(default {server_default})" if server_default else "(default: answer locally)"
    add_connection_arguments(
        parser,
        default_timeout=DEFAULT_TIMEOUT_S,
        server_default=server_default,
        server_help=f"call a moe-control server at HOST:PORT {where}",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def connection(args: argparse.Namespace) -> Connection:
    """The client's connection from the flags; a certificate without its key (or the
    reverse) raises `ValueError`."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("give --tls-cert and --tls-key together (the client certificate)")
    return connection_from_args(args)


def report_failure(error: Exception, *, as_json: bool) -> int:
    """Print a failed call (a grpc.RpcError, ServerNotReadyError, or a bad flag as
    ValueError) and return its exit status."""
    from service.client.errors import ServerNotReadyError

    if isinstance(error, ValueError):
        code_name, message, status = "INVALID_ARGUMENT", str(error), EXIT_BAD_INPUT
    elif isinstance(error, ServerNotReadyError):
        code_name, message, status = "NOT_READY", str(error), EXIT_NOT_READY
    else:
        call: Any = error  # a grpc.RpcError is a grpc.Call as well
        code_name = call.code().name
        message = call.details() or code_name
        status = EXIT_NOT_FOUND if code_name == "NOT_FOUND" else EXIT_SERVER_ERROR
    if as_json:
        print(json.dumps({"error": {"code": code_name, "message": message}}))
    else:
        print(f"error: {code_name}: {message}", file=sys.stderr)
    return status


def print_json(value: Any) -> None:
    print(json.dumps(value))
