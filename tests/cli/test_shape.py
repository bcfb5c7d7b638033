"""`run` and `demo` check their sizes before allocating: a size the oracle, the GPTQ
layout, a backend run here or this machine's memory cannot take is exit 2 with one line
naming the flag, never a traceback or an allocation attempt."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.cli import build_parser
from service.cli.client_flags import BadFlagError
from service.cli.run import DEMO_BACKENDS, _fill_shape
from service.cli.shape import check_shape
from service.client.exits import EXIT_BAD_INPUT


def _check(*argv: str, runs: tuple[str, ...] = DEMO_BACKENDS, makes_layer: bool = True) -> None:
    args = build_parser().parse_args(["run", *argv])
    _fill_shape(args)
    check_shape(args, runs=runs, makes_layer=makes_layer)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--hidden", "100"], "--group-size 32: does not divide --hidden 100"),
        (["--intermediate", "40"], "--group-size 32: does not divide --intermediate 40"),
        (["--tokens", "0"], "--tokens 0: must be an integer >= 1"),
        (["--group-size", "0"], "--group-size 0: must be positive or -1"),
        (["--group-size", "-5"], "--group-size -5: must be positive or -1"),
        (["--experts", "0"], "--experts 0: must be an integer >= 1"),
        (["--experts", "-3"], "--experts -3: must be an integer >= 1"),
        (["--top-k", "9"], "--top-k 9: must not exceed num_experts (8)"),
        (["--hidden", str(2**40)], f"--hidden {2**40}: must be at most"),
        # channelwise: the group rule is gone, GPTQ's packing of K into int32 words is not
        (["--group-size", "-1", "--hidden", "100"], "--hidden 100: K=100 is not a multiple of 8"),
        # the layout takes it (8 divides 136), TRITON's smallest K tile does not
        (["--hidden", "136", "--group-size", "8"], "must be multiples of 16"),
        (["--experts", str(2**30)], "this machine has"),
        (["--tokens", str(2**40)], "this machine has"),
    ],
)
def test_sizes_that_cannot_be_run_name_the_flag(argv: list[str], says: str) -> None:
    with pytest.raises(BadFlagError, match=r"^--") as caught:
        _check(*argv)
    assert says in str(caught.value)


def test_sizes_that_can_be_run_pass() -> None:
    _check()
    _check("--hidden", "256", "--intermediate", "64", "--group-size", "64", "--top-k", "8")
    _check("--group-size", "-1", "--experts", "1", "--top-k", "1")
    # EMULATION alone takes a hidden size no TRITON tile divides
    _check("--hidden", "136", "--group-size", "8", runs=("EMULATION",))


def test_a_held_layer_is_the_servers_only_the_inputs_are_checked() -> None:
    # a layout this client could not make is not its business when the server holds it
    _check("--hidden", "100", makes_layer=False, runs=())
    with pytest.raises(BadFlagError, match="--tokens"):
        _check("--tokens", str(2**40), makes_layer=False, runs=())


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo", "--hidden", "100"], "--hidden 100"),
        (["demo", "--tokens", "0"], "--tokens 0"),
        (["demo", "--group-size", "0"], "--group-size 0"),
        (["run", "--experts", "100000"], "--experts"),
        (["run", "--tokens", "0", "--server", "127.0.0.1:1"], "--tokens 0"),
    ],
)
def test_the_commands_exit_2_with_one_line(argv: list[str], flag: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-control: ") and flag in lines[0], lines
