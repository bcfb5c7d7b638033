"""service.ports against the real kernel: a port bound by `listen` is nobody else's, with or
without SO_REUSEPORT; `check_free` refuses a port any socket listens on, a SO_REUSEPORT
group included; a taken port is named with its flag and variable."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest

from service.ports import PortTakenError, check_free, listen


@pytest.fixture
def reuseport_listener() -> Iterator[int]:
    """A socket listening with SO_REUSEPORT (as a gRPC server with replicas binds): its port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield int(sock.getsockname()[1])
    sock.close()


@pytest.mark.parametrize("reuseport", [False, True])
def test_a_port_listen_binds_refuses_every_other_socket(reuseport: bool) -> None:
    owned = listen("127.0.0.1", 0, "http_port")
    port = owned.getsockname()[1]
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        with pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        other.close()
        owned.close()


def test_a_taken_port_is_named_with_its_flag_and_variable(reuseport_listener: int) -> None:
    with pytest.raises(PortTakenError) as taken:
        listen("127.0.0.1", reuseport_listener, "http_port")
    assert taken.value.port == reuseport_listener
    assert str(taken.value).startswith(
        f"port {reuseport_listener} (--http-port, MOE_CONTROL_HTTP_PORT) is taken"
    )


def test_check_free_refuses_a_reuseport_group_and_a_wildcard_overlap(
    reuseport_listener: int,
) -> None:
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(PortTakenError, match=r"\(--port, MOE_CONTROL_PORT\)"):
            check_free(host, reuseport_listener, "port")


def test_check_free_passes_a_free_port_and_port_zero() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    check_free("127.0.0.1", port, "port")
    check_free("127.0.0.1", 0, "port")


def test_connections_left_in_time_wait_do_not_hold_the_port() -> None:
    owned = listen("127.0.0.1", 0, "port")
    port = owned.getsockname()[1]
    owned.setblocking(True)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = owned.accept()
    accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
    client.close()
    owned.close()
    check_free("127.0.0.1", port, "port")
    listen("127.0.0.1", port, "port").close()
