"""The HTTP/JSON door served by uvicorn on the running asyncio loop (the primary server
process's), on `--host`:`--http-port`, with the gRPC server's TLS settings: `--tls-cert` /
`--tls-key`, and with `--tls-client-ca` a client certificate signed by it required (mTLS).

uvicorn's `Server.serve` installs its own signal handlers; the primary owns SIGTERM and
SIGINT, so the door runs uvicorn's parts itself: `startup` on a socket bound here (port 0
resolves before anything is announced) after the lifespan `_serve` would make ("off":
no ASGI lifespan events), `main_loop` as a task, and on stop `shutdown`,
which gives in-flight requests `--grace-s`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette

from service import ports
from service.api.codecs.answer_cache import AnswerCache
from service.api.interceptors.limits import Limits
from service.api.servicer import SelectionServicer
from service.http.app import build_app
from service.http.handlers import Plane
from service.http.state import PrimaryState
from service.http.transport import CoalescingHttpToolsProtocol
from service.metrics import Metrics
from service.settings import MIB, Settings


@dataclass
class HttpDoor:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    tls: bool
    #: The listening socket (the primary hands it to its replicas).
    listener: socket.socket

    def url(self, host: str) -> str:
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, give in-flight requests the grace, close."""
        self.server.should_exit = True
        await self.task
        await self.server.shutdown()


def inherited(fd: int) -> socket.socket:
    """The primary's listening socket, inherited by a replica as descriptor `fd`."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return sock


async def start_http(
    app: Starlette, settings: Settings, *, sock: socket.socket | None = None
) -> HttpDoor:
    """Serve `app` on this loop from `sock` (a replica's, inherited from the primary), or
    else from a socket bound here on `settings.host`:`settings.http_port` that no other
    process can share (service.ports: PortTakenError names --http-port when it is taken).
    Its protocol is named TCP (ports.py), so asyncio turns Nagle's algorithm off on every
    accepted connection: with it on, a write that follows another unacknowledged one waits
    for the client's delayed ACK, about 40 ms per keep-alive request."""
    tls = settings.tls_cert is not None and settings.tls_key is not None
    config = uvicorn.Config(
        app,
        # asyncio accepts up to `backlog` connections each time the socket is readable: one,
        # so the server processes that share this socket take a burst of connections by
        # turns, not one process all of it (the kernel's queue is set again below).
        backlog=1,
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,  # no proxy is trusted: the client address is the socket's
        http=CoalescingHttpToolsProtocol,
        timeout_graceful_shutdown=int(settings.grace_s) or 1,
        ssl_certfile=str(settings.tls_cert) if tls else None,
        ssl_keyfile=str(settings.tls_key) if tls else None,
        ssl_ca_certs=str(settings.tls_client_ca) if tls and settings.tls_client_ca else None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls and settings.tls_client_ca else ssl.CERT_NONE,
    )
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # what Server._serve sets up ("off")
    if sock is None:
        sock = ports.listen(settings.host, settings.http_port, "http_port")
    port = sock.getsockname()[1]
    await server.startup(sockets=[sock])
    sock.listen(ports.LISTEN_BACKLOG)  # asyncio listened with `backlog`: the queue again
    task = asyncio.create_task(server.main_loop())
    return HttpDoor(server, task, port, tls, sock)


async def open_http(
    settings: Settings,
    *,
    metrics: Metrics,
    selection: SelectionServicer,
    state: PrimaryState,
    ready: Callable[[], bool],
    limits: Limits | None,
    sock: socket.socket | None = None,
) -> HttpDoor:
    """The door of a server process: its SelectionServicer's selector and listings, the
    primary's state (its own in the primary, asked of it in a replica), its readiness and
    its gRPC server's limits, served from `sock` (a replica's: the primary's listening
    socket, inherited) or a socket of its own on `settings.http_port` (the primary's)."""
    plane = Plane(
        selector=selection.selector,
        presets=selection.presets,
        rulesets=selection.rulesets,
        state=state,
        ready=ready,
        cache=AnswerCache(settings.select_cache_mib * MIB) if settings.select_cache_mib else None,
        offload=selection.offload,
    )
    app = build_app(plane, settings, metrics, limits)
    return await start_http(app, settings, sock=sock)
