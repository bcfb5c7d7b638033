"""`moe-control observed`: the WNA16 MoE decisions vLLM processes reported taking (through
the moe-control vLLM plugin), each distinct deployment with its count, release and backend,
and, where the server's own answer differs, both answers and the first field that differs
(ListObservedDecisions). A release no ruleset models is said so, with the ruleset it was
compared with instead and how to add its own."""

from __future__ import annotations

import argparse
import json
from typing import Any

from service.cli import remote
from service.client.exits import EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "observed",
        help="decisions vLLM processes reported, beside the server's own answers",
        description="List the distinct WNA16 MoE decisions vLLM processes reported to a "
        "server (ListObservedDecisions): count, vLLM release, backend, and for a mismatch "
        "both answers and the first field that differs.",
    )
    remote.add_flags(parser, server_default=remote.DEFAULT_SERVER)
    parser.add_argument(
        "--mismatches",
        action="store_true",
        help="only the deployments where the server's answer differs from vLLM's",
    )
    parser.set_defaults(handler=run)


def _answer(side: dict[str, Any]) -> str:
    error = side.get("error") or {}
    if error.get("type"):
        return f"raises {error['type']}"
    backend = side.get("backend") or "none"
    return f"{backend} ({side.get('experts_class') or '-'})"


def _layer(deployment: dict[str, Any]) -> str:
    try:
        layer = json.loads(deployment["observed"]["deployment_json"]).get("layer", {})
    except (ValueError, AttributeError):
        return "-"
    return f"E={layer.get('num_experts')} k={layer.get('top_k')} h={layer.get('hidden_size')}"


def render_table(listing: dict[str, Any]) -> str:
    deployments = listing["deployments"]
    mismatches = sum(1 for d in deployments if d["first_difference"])
    lines = [f"{len(deployments)} observed deployments, {mismatches} mismatched"]
    unmodelled = sorted({d["vllm_version"] for d in deployments if d.get("release_not_modelled")})
    if unmodelled:
        lines[0] += f"; releases not modelled: {', '.join(v or '(unknown)' for v in unmodelled)}"
    if listing["evicted"]:
        lines[0] += f" ({listing['evicted']} older ones dropped from the store)"
    rows = [["COUNT", "VLLM", "RULESET", "INTEGRATION", "LAYER", "OBSERVED", "MATCH"]]
    for d in deployments:
        observed = d["observed"]
        if d["first_difference"]:
            match = f"differs at {d['first_difference']}"
        elif not d.get("predicted"):
            match = "not compared"
        else:
            match = "yes"
        rows.append(
            [
                str(d["count"]),
                (d["vllm_version"] or "-")
                + (" (not modelled)" if d.get("release_not_modelled") else ""),
                d["ruleset"] or "-",
                observed["integration"] or "-",
                _layer(d),
                _answer(observed),
                match,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.extend(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    for d in deployments:
        where = f"{d['key']} (first layer {d['observed']['layer_name']})"
        if d.get("release_not_modelled"):
            lines.append(f"release not modelled {where}: {d['note']}")
        if d["first_difference"]:
            lines.append(
                f"mismatch {where}: vLLM {_answer(d['observed'])}, "
                f"{d['ruleset']} says {_answer(d['predicted'])}; first difference "
                f"{d['first_difference']}: vLLM {d['observed_value']!r}, "
                f"server {d['predicted_value']!r}"
            )
        elif d["note"] and not d.get("predicted") and not d.get("release_not_modelled"):
            lines.append(f"not compared {where}: {d['note']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc

    from service.client.errors import ServerNotReadyError
    from service.client.inventory import list_observed

    try:
        listing = list_observed(remote.connection(args), mismatches_only=args.mismatches)
    except (grpc.RpcError, ServerNotReadyError, ValueError) as error:
        return remote.report_failure(error, as_json=args.json)
    if args.json:
        remote.print_json(listing)
    else:
        print(render_table(listing))
    return EXIT_OK
