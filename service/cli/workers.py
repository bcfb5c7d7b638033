"""`moe-control workers`: a server's worker processes, their devices, states, restarts,
kept-layer memory and platforms (ListWorkers)."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli import remote
from service.client.exits import EXIT_OK

_MIB = 1 << 20


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "workers",
        help="a server's workers: device, state, restarts, layer memory, platform",
        description="List a server's worker processes (ListWorkers) and whether it is ready.",
    )
    remote.add_flags(parser, server_default=remote.DEFAULT_SERVER)
    parser.set_defaults(handler=run)


def _mib(value: str | int) -> str:
    return f"{int(value) / _MIB:.0f} MiB"


def render_table(listing: dict[str, Any]) -> str:
    state = "ready" if listing["ready"] else "not ready"
    lines = [f"server {state}: {listing['ready_workers']} of {len(listing['workers'])} ready"]
    rows = [["WORKER", "DEVICE", "STATE", "PID", "RESTARTS", "LAYERS", "PLATFORM"]]
    for worker in listing["workers"]:
        platform = worker["platform"]
        budget = int(worker["layer_budget_bytes"])
        layers = f"{len(worker['layer_ids'])} ({_mib(worker['layer_bytes'])}"
        layers += f" of {_mib(budget)})" if budget else ")"
        rows.append(
            [
                str(worker["index"]),
                f"{worker['device']} {worker['device_name']}".strip(),
                worker["state"].removeprefix("WORKER_STATE_").lower(),
                str(worker["pid"]),
                str(worker["restarts"]),
                layers,
                _platform_text(platform),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.extend(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    for worker in listing["workers"]:
        if worker["last_exit_reason"]:
            lines.append(f"worker {worker['index']} last exit: {worker['last_exit_reason']}")
    return "\n".join(lines)


def _platform_text(platform: dict[str, Any] | None) -> str:
    if platform is None:
        return "not reported yet"
    parts = [platform["device"]]
    if platform["capability"]:
        parts.append(f"sm {platform['capability']}")
    if platform["arch"]:
        parts.append(platform["arch"])
    if platform["device"] == "cpu":
        parts.append("amx" if platform["amx"] else "no amx")
    parts.append("packages: " + (",".join(platform["packages"]) or "none"))
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    import grpc

    from service.client.errors import ServerNotReadyError
    from service.client.inventory import list_workers

    try:
        listing = list_workers(remote.connection(args))
    except (grpc.RpcError, ServerNotReadyError, ValueError) as error:
        return remote.report_failure(error, as_json=args.json)
    if args.json:
        remote.print_json(listing)
    else:
        print(render_table(listing))
    return EXIT_OK
