"""The JSON-lines pipe protocol between server and worker."""

from __future__ import annotations

import pytest

from service.ipc import protocol
from service.ipc.errors import ProtocolError


def test_round_trip() -> None:
    line = protocol.request(3, "ping", {"a": [1, 2]})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode(line) == {"id": 3, "method": "ping", "params": {"a": [1, 2]}}
    assert protocol.decode(protocol.error(3, "E", "m")) == {
        "id": 3,
        "error": {"type": "E", "message": "m"},
    }


@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n", b"\xff\xfe\n"])
def test_malformed_lines_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(line)


def test_oversized_messages_are_refused() -> None:
    with pytest.raises(ProtocolError):
        protocol.encode({"blob": "x" * protocol.MAX_LINE_BYTES})
    with pytest.raises(ProtocolError):
        protocol.decode(b"{" + b" " * protocol.MAX_LINE_BYTES + b"}")


def test_nan_is_not_json() -> None:
    with pytest.raises(ValueError):
        protocol.encode({"x": float("nan")})
