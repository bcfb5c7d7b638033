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

    def url(self, host: str) -> str:
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, give in-flight requests the grace, close."""
        self.server.should_exit = True
        await self.task
        await self.server.shutdown()


def _bind(host: str, port: int, *, reuseport: bool = False) -> socket.socket:
    """The listening socket. Its protocol is named (IPPROTO_TCP, not 0): asyncio turns
    Nagle's algorithm off (TCP_NODELAY) only on accepted sockets that say they are TCP, and
    with it on, a write that follows another unacknowledged one waits for the client's
    delayed ACK, about 40 ms per keep-alive request. With `reuseport` (several server
    processes), every process listens on the same port and the kernel spreads connections
    among them, as for gRPC."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def start_http(
    app: Starlette, settings: Settings, *, port: int | None = None, reuseport: bool = False
) -> HttpDoor:
    """Bind `settings.host`:`port` (default `settings.http_port`) and serve `app` on this
    loop (OSError when the address cannot be bound)."""
    tls = settings.tls_cert is not None and settings.tls_key is not None
    config = uvicorn.Config(
        app,
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
    sock = _bind(settings.host, settings.http_port if port is None else port, reuseport=reuseport)
    port = sock.getsockname()[1]
    await server.startup(sockets=[sock])
    task = asyncio.create_task(server.main_loop())
    return HttpDoor(server, task, port, tls)


async def open_http(
    settings: Settings,
    *,
    metrics: Metrics,
    selection: SelectionServicer,
    state: PrimaryState,
    ready: Callable[[], bool],
    limits: Limits | None,
    port: int | None = None,
    reuseport: bool = False,
) -> HttpDoor:
    """The door of a server process: its SelectionServicer's selector and listings, the
    primary's state (its own in the primary, asked of it in a replica), its readiness and
    its gRPC server's limits, served on `port` (default `settings.http_port`; with
    `reuseport`, beside the other server processes)."""
    plane = Plane(
        selector=selection.selector,
        presets=selection.presets,
        rulesets=selection.rulesets,
        state=state,
        ready=ready,
        cache=AnswerCache(settings.select_cache_mib * MIB) if settings.select_cache_mib else None,
    )
    app = build_app(plane, settings, metrics, limits)
    return await start_http(app, settings, port=port, reuseport=reuseport)
