"""docs/upgrading.md works as written: every local `moe-control diff` command of its code
blocks runs against the files it names (the example fleet ships in docs/examples), and the
session it shows is what the command prints."""

from __future__ import annotations

import re
import shlex

import pytest

from service.cli import main
from tests.docs.markdown import ROOT

PAGE = ROOT / "docs" / "upgrading.md"
CLI = "moe-control "


def blocks() -> list[str]:
    return re.findall(r"^```\n(.*?)^```", PAGE.read_text(), re.M | re.S)


def commands() -> list[str]:
    """Every `moe-control diff` command line, comments cut, that runs without a server."""
    lines = [line.strip() for block in blocks() for line in block.splitlines()]
    return [
        line.partition("#")[0].strip()
        for line in lines
        if line.startswith(CLI + "diff ") and "--server" not in line
    ]


def test_every_local_command_runs_against_the_files_it_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    lines = commands()
    assert any("docs/examples/fleet.jsonl" in line for line in lines)
    for line in lines:
        status = main(shlex.split(line)[1:])
        captured = capsys.readouterr()
        assert status in (0, 1), (line, captured.err)  # an answer, never bad input
        assert captured.out.strip(), line


def test_the_shown_session_is_what_the_command_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every line shown is printed, in order, and nothing else; a line cut with "..."
    stands for its beginning."""
    monkeypatch.chdir(ROOT)
    sessions = [b.splitlines() for b in blocks() if b.startswith("$ " + CLI + "diff ")]
    assert sessions
    for command, *shown in sessions:
        status = main(shlex.split(command.removeprefix("$ "))[1:])
        printed = capsys.readouterr().out.splitlines()
        assert status == 1, command  # the example fleet's gated changes fail the gate
        assert len(printed) == len(shown), command
        for line, out in zip(shown, printed, strict=True):
            if line.endswith("..."):
                assert out.startswith(line.removesuffix("...").rstrip()), (line, out)
            else:
                assert out == line
