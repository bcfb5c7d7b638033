"""The flags every inventory command shares (`presets`, `workers`, `layers`, `unload`):
where the server is, how to authenticate, how long to wait, and how a failed call is told.

grpc is imported only when a command calls a server, so `presets` and `rulesets` stay
local tools that run without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.client.inventory import Connection

DEFAULT_SERVER = "localhost:50151"
DEFAULT_TIMEOUT_S = 10.0

EXIT_OK = 0
#: The server answered NOT_FOUND (an unknown layer id or worker).
EXIT_NOT_FOUND = 1
EXIT_BAD_INPUT = 2
#: Any other failed call: unreachable, timed out, refused.
EXIT_SERVER_ERROR = 3


def add_connection_flags(parser: argparse.ArgumentParser, *, server_default: str | None) -> None:
    """--server, --token, --tls-*, --timeout, --wait-ready and --json."""
    where = f"(default {server_default})" if server_default else "(default: answer locally)"
    parser.add_argument("--server", default=server_default, help=f"HOST:PORT {where}")
    parser.add_argument("--token", help="bearer token (default: $MOE_CONTROL_AUTH_TOKEN)")
    parser.add_argument("--tls-ca", type=Path, help="CA bundle to verify the server over TLS")
    parser.add_argument("--tls-cert", type=Path, help="client certificate chain (mTLS)")
    parser.add_argument("--tls-key", type=Path, help="private key of --tls-cert")
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds the call may take, waiting included (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--wait-ready",
        action="store_true",
        help="wait (up to --timeout) for the server to accept the call instead of failing "
        "UNAVAILABLE at once, e.g. right after `serve` started",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("seconds must be positive")
    return value


def connection(args: argparse.Namespace) -> Connection:
    """The client's connection from the flags; bad TLS flags raise `ValueError`."""
    from service.client.inventory import Connection

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("give --tls-cert and --tls-key together (the client certificate)")
    return Connection(
        target=args.server,
        token=args.token,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        timeout=args.timeout,
        wait_ready=args.wait_ready,
    )


def report_failure(error: Exception, *, as_json: bool) -> int:
    """Print a failed call (a grpc.RpcError, or a bad flag as ValueError); its exit status."""
    code_name, message, status = "INVALID_ARGUMENT", str(error), EXIT_BAD_INPUT
    if not isinstance(error, ValueError):
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
