"""The `moe-control` command line: one sub-command module per verb.

Each module in `COMMANDS` exposes `register(subparsers)`, which adds its parser and sets
`handler` (a callable taking the parsed namespace and returning the exit status). Keeping
verbs in their own modules keeps the local tools (which must not import grpc) apart from the
server and client ones.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from service import __version__
from service.cli import grpc_defaults
from service.cli.client_flags import BadFlagError
from service.client.exits import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED

#: Sub-command modules, in the order `--help` lists them.
COMMANDS: tuple[str, ...] = (
    "service.cli.select",
    "service.cli.diff",
    "service.cli.convert",
    "service.cli.run",
    "service.cli.serve",
    "service.cli.health",
    "service.cli.presets",
    "service.cli.workers",
    "service.cli.layers",
    "service.cli.unload",
    "service.cli.rulesets",
    "service.cli.observed",
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
    """Run one command; its exit status. A closed stdout ends any command quietly with
    `EXIT_BROKEN_PIPE` (Python ignores SIGPIPE, so the write raises instead)."""
    try:
        try:
            status = _dispatch(argv)
        finally:
            sys.stdout.flush()  # inside the guard: a pipe closed at the last write counts too
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except BadFlagError as exc:
        print(f"moe-control: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        # One line, never a traceback: what happened and how to go on (a command that
        # keeps its work says so through `interrupted`).
        print(f"\nmoe-control: interrupted; {_interrupted_hint(argv)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return status


#: What a command that was interrupted leaves, and how to go on (default: nothing to resume).
INTERRUPTED_HINTS: dict[str, str] = {
    "convert": "the layers already converted are kept: run the same command again to resume",
}


def _interrupted_hint(argv: Sequence[str] | None) -> str:
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((w for w in words if not w.startswith("-")), "")
    return INTERRUPTED_HINTS.get(command, "nothing was left half-done; run it again")


def _dispatch(argv: Sequence[str] | None) -> int:
    # Before any sub-command module can import grpc (grpc_defaults says why).
    grpc_defaults.apply()
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    status: int = handler(args)
    return status


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's own flush at exit finds no closed
    pipe and prints nothing (Python's documented recipe for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (a test's capture)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
