"""The CLI's gRPC defaults: set before grpc loads, never over an operator's choice."""

from __future__ import annotations

import os
import subprocess
import sys

from service.cli import grpc_defaults
from service.cli.grpc_defaults import GRPC_EXPERIMENTS_DEFAULT

_PROBE = (
    "import os; import service.cli.grpc_defaults as d; d.apply(); import grpc; "
    "print(os.environ.get('GRPC_EXPERIMENTS', '<unset>'))"
)


def _run(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"} | env
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_fresh_process_gets_the_default_before_grpc_loads() -> None:
    assert _run(_PROBE) == GRPC_EXPERIMENTS_DEFAULT


def test_the_cli_entry_applies_it_before_any_sub_command_imports_grpc() -> None:
    code = (
        "import os, sys; from service.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('GRPC_EXPERIMENTS', '<unset>'), 'grpc' in sys.modules)"
    )
    # `main` applies the default first (building the parser does not load grpc: the local
    # verbs never need it); --version then exits inside argparse
    assert _run(code).splitlines()[-1] == f"{GRPC_EXPERIMENTS_DEFAULT} False"


def test_an_operators_value_wins_even_when_empty() -> None:
    assert _run(_PROBE, GRPC_EXPERIMENTS="") == ""
    assert _run(_PROBE, GRPC_EXPERIMENTS="-event_engine_client") == "-event_engine_client"


def test_nothing_changes_once_grpc_is_loaded() -> None:
    environ: dict[str, str] = {}
    assert "grpc" in sys.modules or __import__("grpc")
    assert grpc_defaults.apply(environ) is False
    assert environ == {}
