"""`moe-control health`: ask a server's standard gRPC health service (a probe's view)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from service.api.names import SERVICE_NAME as SERVICE
from service.cli.client_flags import add_connection_arguments, connection_from_args
from service.client.exits import EXIT_NOT_FOUND, EXIT_NOT_READY, EXIT_OK, EXIT_SERVER_ERROR


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "health",
        help="check a server's liveness or readiness (grpc.health.v1)",
        description="Print SERVING or NOT_SERVING for a running server and exit 0 only when "
        f"it is SERVING. Liveness is the empty service name; --ready asks for {SERVICE} "
        "(SERVING while a worker is ready). --wait-ready waits until the asked service is "
        "SERVING.",
    )
    add_connection_arguments(
        parser, default_timeout=5.0, server_default="localhost:50151", server_help="HOST:PORT",
        token=False,
    )  # fmt: skip
    parser.add_argument("--ready", action="store_true", help=f"readiness ({SERVICE})")
    parser.add_argument("--service", help="any service name (overrides --ready)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from service.client.errors import ServerNotReadyError
    from service.client.health import check_health, unknown_service_message

    service = args.service if args.service is not None else (SERVICE if args.ready else "")
    try:
        status = check_health(connection_from_args(args), service)
    except ServerNotReadyError as exc:
        print(f"moe-control health: {exc}", file=sys.stderr)
        return EXIT_NOT_READY
    except grpc.RpcError as error:
        call: Any = error  # a grpc.Call as well
        code = call.code()
        if code is grpc.StatusCode.NOT_FOUND:
            print(f"{code.name}: {unknown_service_message(service)}")
            return EXIT_NOT_FOUND
        print(f"{code.name}: {call.details() or 'no message from the server'}")
        return EXIT_SERVER_ERROR  # no answer at all: unreachable, refused, out of time
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_NOT_READY
