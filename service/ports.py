"""The ports a server owns: bound against every other process, a taken one named by its
setting.

Two kernel rules decide who may listen on a TCP port (Linux):

- A socket bound without `SO_REUSEPORT` shares its port with nobody: any later bind to
  it, with or without `SO_REUSEPORT`, by any process, fails with EADDRINUSE. Several
  processes can still serve it by accepting on that one socket, inherited (`listen`).
- Sockets bound with `SO_REUSEPORT` form a group that any later socket with the option
  joins if it belongs to the same user: the kernel cannot tell a server's own processes
  from another program run by the same account.

So a port is owned by binding it without `SO_REUSEPORT` and handing the socket to the
other processes that serve it, which is what the HTTP door does. A gRPC server binds by
address only (grpcio cannot adopt a socket it did not create), so replicas of the gRPC
port need `SO_REUSEPORT`; for that port `check_free` first binds a socket without the
option, which fails while any other process listens there, whoever it is and however it
bound. What it cannot refuse is a program that binds the port later, with
`SO_REUSEPORT`, as the same user (docs/server.md, "Ports").
"""

from __future__ import annotations

import errno
import socket

from service.settings import Settings

#: Connections the kernel queues for a listening socket until a process accepts them.
LISTEN_BACKLOG = 2048
#: The Settings fields that are ports a server listens on.
PORT_FIELDS = ("port", "http_port", "metrics_port")


class PortTakenError(OSError):
    """Another process listens on a port this server was told to own."""

    def __init__(self, host: str, port: int, setting: str) -> None:
        self.host = host
        self.port = port
        self.setting = setting
        where = f"{host}:{port}" if host else str(port)
        self.message = (
            f"port {port} ({Settings.flag_name(setting)}, {Settings.env_name(setting)}) is "
            f"taken: another process listens on {where}; stop it or choose another port"
        )
        super().__init__(errno.EADDRINUSE, self.message)

    def __str__(self) -> str:
        return self.message


def _socket(host: str) -> tuple[socket.socket, tuple[str, int]]:
    """A TCP socket for `host` and its bind address's host part. The protocol is named
    (IPPROTO_TCP, not 0): asyncio turns Nagle's algorithm off only on accepted sockets that
    say they are TCP."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # SO_REUSEADDR: connections a former server left in TIME_WAIT do not hold the port.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock, (bare, 0)


def listen(host: str, port: int, setting: str, *, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A listening socket on `host`:`port` that no other process can share (no
    `SO_REUSEPORT`), non-blocking; PortTakenError naming `setting` when the port is
    taken, OSError for any other failure to bind."""
    sock, (bare, _) = _socket(host)
    try:
        sock.bind((bare, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortTakenError(host, port, setting) from None
        raise
    sock.setblocking(False)
    return sock


def check_free(host: str, port: int, setting: str) -> None:
    """PortTakenError naming `setting` while any other process listens on `host`:`port`
    (a bind without `SO_REUSEPORT` conflicts with every listener, grouped or not); port 0
    is always free. Other failures to bind are left to the real bind, which reports them."""
    if port == 0:
        return
    sock, (bare, _) = _socket(host)
    try:
        sock.bind((bare, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortTakenError(host, port, setting) from None
    finally:
        sock.close()
