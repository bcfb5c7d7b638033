"""`moe-control rulesets`: the vLLM releases whose rules the oracle reproduces, from its
ruleset registry (locally: the server decides by the same registry, and there is no RPC
that lists it), with the backends each knows and the `--moe-backend` values it accepts."""

from __future__ import annotations

import argparse
import json
from typing import Any

from service.oracle import DEFAULT_RULESET, RULESETS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "rulesets",
        help="the vLLM releases the oracle decides by (select --ruleset)",
        description="List the oracle's rulesets (one per vLLM release), which is the default, "
        "the backends each knows and the --moe-backend values it accepts.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def rulesets_json() -> list[dict[str, Any]]:
    return [
        {
            "name": ruleset.name,
            "default": ruleset.name == DEFAULT_RULESET,
            "backends": list(ruleset.backends),
            "moe_backends": sorted(ruleset.user_backends),
        }
        for ruleset in RULESETS.values()
    ]


def run(args: argparse.Namespace) -> int:
    listing = rulesets_json()
    if args.json:
        print(json.dumps(listing))
        return 0
    for entry in listing:
        default = " (default)" if entry["default"] else ""
        print(f"{entry['name']}{default}")
        print(f"  backends: {', '.join(entry['backends'])}")
        print(f"  --moe-backend: {', '.join(entry['moe_backends'])}")
    return 0
