"""`moe-control health`: ask a server's standard gRPC health service (a probe's view)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SERVICE = "moe_control.v1.MoeControlService"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "health",
        help="check a server's liveness or readiness (grpc.health.v1)",
        description="Print SERVING or NOT_SERVING for a running server and exit 0 only when "
        f"it is SERVING. Liveness is the empty service name; --ready asks for {SERVICE} "
        "(SERVING only while every worker is ready).",
    )
    parser.add_argument("--server", default="localhost:50151", help="HOST:PORT")
    parser.add_argument("--ready", action="store_true", help=f"readiness ({SERVICE})")
    parser.add_argument("--service", help="any service name (overrides --ready)")
    parser.add_argument("--tls-ca", type=Path, help="CA bundle to verify the server")
    parser.add_argument("--tls-cert", type=Path, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, help="client key (mTLS)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from service.client.health import check_health

    service = args.service if args.service is not None else (SERVICE if args.ready else "")
    try:
        status = check_health(
            args.server,
            service,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            timeout=args.timeout,
        )
    except grpc.RpcError as error:
        call: Any = error  # a grpc.Call as well
        print(f"{call.code().name}: {call.details()}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1
