"""`moe-control rulesets`: the vLLM releases whose rules the oracle reproduces, from its
ruleset registry, or with `--server` as that server lists them (ListRulesets): each one's
name, the vLLM releases it answers for, that release's torch and humming-kernels pins,
which is the default, the backends it knows and the `--moe-backend` values it accepts."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli import remote
from service.client.exits import EXIT_OK
from service.oracle.rulesets import listing


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "rulesets",
        help="the vLLM releases the oracle decides by (select --ruleset)",
        description="List the oracle's rulesets (one per vLLM release): the vLLM versions "
        "each answers for, that release's torch and humming-kernels pins, which is the "
        "default (the newest), the backends each knows and the --moe-backend values it "
        "accepts. A ruleset may be named as 'vllm-0.33', '0.33', '0.33.0' or 'v0.33.0'. "
        "Locally, or with --server as that server lists them (ListRulesets).",
    )
    remote.add_flags(parser, server_default=None)
    parser.set_defaults(handler=run)


def render(rulesets: list[dict[str, Any]]) -> str:
    lines = []
    for entry in rulesets:
        default = " (default)" if entry["default"] else ""
        lines += [
            f"{entry['name']}{default}",
            f"  vllm: {entry['vllm']}",
            f"  torch: {entry['torch']}",
            f"  humming-kernels: {entry['humming_kernels']}",
            f"  backends: {', '.join(entry['backends'])}",
            f"  --moe-backend: {', '.join(entry['moe_backends'])}",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.server is None:
        rulesets = listing()
    else:
        import grpc

        from service.client.errors import ServerNotReadyError
        from service.client.inventory import list_rulesets

        try:
            rulesets = list_rulesets(remote.connection(args))
        except (grpc.RpcError, ServerNotReadyError, ValueError) as error:
            return remote.report_failure(error, as_json=args.json)
    if args.json:
        remote.print_json(rulesets)
    else:
        print(render(rulesets))
    return EXIT_OK
