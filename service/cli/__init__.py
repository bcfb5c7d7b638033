"""The `moe-control` command line: one sub-command module per verb.

Each module in `COMMANDS` exposes `register(subparsers)`, which adds its parser and sets
`handler` (a callable taking the parsed namespace and returning the exit status). Keeping
verbs in their own modules keeps the local tools (which must not import grpc) apart from the
server and client ones.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from service import __version__
from service.cli import grpc_defaults

#: Sub-command modules, in the order `--help` lists them.
COMMANDS: tuple[str, ...] = (
    "service.cli.select",
    "service.cli.convert",
    "service.cli.run",
    "service.cli.serve",
    "service.cli.health",
    "service.cli.presets",
    "service.cli.workers",
    "service.cli.layers",
    "service.cli.unload",
    "service.cli.rulesets",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-control",
        description="Control plane for quantized MoE kernels: vLLM's WNA16 backend oracle, "
        "weight conversion and fused MoE forward.",
    )
    parser.add_argument("--version", action="version", version=f"moe-control {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Before any sub-command module can import grpc (grpc_defaults says why).
    grpc_defaults.apply()
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    status: int = handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
