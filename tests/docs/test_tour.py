"""The README's five-minute tour works as written: its local commands run through the real
entry point, and the answers its comments promise are the answers given (the demo itself is
run by tests/cli/test_run.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from service.cli import main
from tests.docs.markdown import ROOT

README = ROOT / "README.md"
CLI = ".venv/bin/moe-control "
PYTHON = ".venv/bin/python -c "


def tour_lines() -> list[str]:
    """Every command line of the README's code blocks."""
    blocks = re.findall(r"^```\n(.*?)^```", README.read_text(), re.M | re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def split(line: str, tmp_path: Path) -> tuple[list[str], str]:
    """argv after `moe-control`, with /tmp/ moved under tmp_path, and the line's comment."""
    command, _, comment = line.partition("#")
    argv = shlex.split(command.replace("/tmp/", f"{tmp_path}/"))[1:]
    return argv, comment.strip()


def test_the_local_selections_answer_what_their_comments_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [line for line in tour_lines() if line.startswith(CLI + "select --config")]
    assert len(lines) >= 2
    for line in lines:
        argv, comment = split(line, tmp_path)
        assert main(argv) == 0, line
        out = capsys.readouterr().out
        if comment:
            assert f"backend: {comment}" in out, line


def transcripts() -> list[tuple[str, list[str]]]:
    """The tour's shown sessions: each `$ .venv/bin/moe-control ...` line with the output
    lines printed under it (up to the next prompt or the block's end)."""
    blocks = re.findall(r"^```\n(.*?)^```", README.read_text(), re.M | re.S)
    sessions: list[tuple[str, list[str]]] = []
    for block in blocks:
        for line in block.splitlines():
            if line.startswith("$ "):
                sessions.append((line[2:], []))
            elif sessions and sessions[-1][0] and line.strip():
                sessions[-1][1].append(line)
        sessions.append(("", []))  # a block's end closes its session
    return [(command, output) for command, output in sessions if command]


def test_the_shown_output_is_what_the_commands_print(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every output line the README shows is printed by its command, in order; a line cut
    with "..." stands for its beginning, and a line of "..." alone for lines left out."""
    sessions = transcripts()
    assert len(sessions) >= 2
    for command, shown in sessions:
        assert command.startswith(CLI), command
        argv, _ = split(command, tmp_path)
        main(argv)
        printed = capsys.readouterr().out.splitlines()
        at = 0
        for line in shown:
            if line.strip() == "...":
                continue
            prefix = line.removesuffix("...").rstrip() if line.endswith("...") else line
            found = next(
                (i for i in range(at, len(printed)) if printed[i].startswith(prefix)), None
            )
            assert found is not None, f"{command!r} does not print {line!r}"
            at = found + 1


def test_the_checkpoint_is_written_converted_and_then_verified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (writer,) = [line for line in tour_lines() if line.startswith(PYTHON)]
    code = shlex.split(writer.replace("/tmp/", f"{tmp_path}/"))[2]
    exec(code, {})  # the tour's own one-liner
    converts = [line for line in tour_lines() if line.startswith(CLI + "convert /tmp/")]
    assert len(converts) == 2
    for line in converts:
        argv, _ = split(line, tmp_path)
        assert main(argv) == 0, line
    assert "0 layers converted, 2 verified" in capsys.readouterr().out
