"""`moe-control demo` (smoke: a subprocess on this CPU machine, nothing external started)
and `moe-control run` locally."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.cli import main


def test_demo_runs_on_cpu_and_prints_the_table() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "demo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for step in ("1. Quantize", "2. Ask the oracle", "3. Convert", "4. Compare"):
        assert step in out
    assert "h100          -> " in out
    rows = [line for line in out.splitlines() if line.startswith(("EMULATION", "TRITON"))]
    assert len(rows) == 2 and all(row.endswith("ok") for row in rows), out


def test_run_locally_prints_one_row(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["run", "--backend", "emulation", "--experts", "4", "--tokens", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.splitlines()[-1].startswith("EMULATION") and out.rstrip().endswith("ok")


def test_run_with_a_backend_that_cannot_run_here_fails_clearly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["run", "--backend", "nope", "--experts", "4", "--tokens", "2"])
    assert status == 1
    assert "error:" in capsys.readouterr().err


def test_top_k_is_spelled_with_a_hyphen(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["run", "--top-k", "1", "--experts", "4", "--tokens", "2"])
    assert status == 0, capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--top_k", "1"])


def test_run_exits_1_over_the_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["run", "--experts", "4", "--tokens", "2", "--tolerance", "0"])
    assert status == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL (> 0)")
