"""Exit statuses and flags every command shares: one table of exit codes, --server as a
URL, and a bad flag ending in one line with exit 2, never a traceback."""

from __future__ import annotations

import pytest

from service.cli import main
from service.cli.client_flags import BadFlagError, server_address
from service.client import exits


def test_one_table_of_exit_codes() -> None:
    assert (exits.EXIT_OK, exits.EXIT_BAD_INPUT, exits.EXIT_SERVER_ERROR) == (0, 2, 3)
    assert exits.EXIT_INTERRUPTED == 130
    assert {exits.EXIT_SELECTION_FAILED, exits.EXIT_NOT_FOUND, exits.EXIT_NOT_READY} == {1}


@pytest.mark.parametrize(
    ("given", "tls", "address"),
    [
        ("localhost:50151", False, "localhost:50151"),
        ("http://localhost:50151", False, "localhost:50151"),
        ("http://localhost:50151/", False, "localhost:50151"),
        ("HTTPS://moe.example:443", True, "moe.example:443"),
    ],
)
def test_a_server_url_is_its_host_and_port(given: str, tls: bool, address: str) -> None:
    assert server_address(given, tls=tls) == address


@pytest.mark.parametrize(
    ("given", "tls", "says"),
    [
        ("https://moe.example:443", False, "--tls-ca"),
        ("http://moe.example:80", True, "plaintext"),
        ("grpc://moe.example:80", False, "HOST:PORT"),
        ("http://moe.example:80/v1", False, "no path"),
    ],
)
def test_a_url_that_disagrees_is_refused(given: str, tls: bool, says: str) -> None:
    with pytest.raises(BadFlagError, match=says):
        server_address(given, tls=tls)


def test_a_bad_server_url_is_exit_2_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--server", "ftp://localhost:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--server ftp://localhost:1" in err
    assert "Traceback" not in err
