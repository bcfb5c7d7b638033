"""The other front doors a server process opens beside gRPC (the HTTP/JSON API,
service.http): what the server hands them and what it keeps of them.

The server cannot import service.http (a sibling floor), so the CLI's `serve` passes the
openers in: `DoorFactory` for the primary (primary.py), which takes the started server, and
`ReplicaDoorFactory` for a replica, which takes the replica's `ReplicaDoorPlane` (its
selection and limits, its view of readiness, the channel to the primary's private server).
The primary's door binds its port first, alone (service.ports); the replicas' accept on
that very socket, inherited.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from service.api.interceptors.limits import Limits
from service.api.servicer import SelectionServicer
from service.metrics import Metrics
from service.settings import Settings


class OpenDoor(Protocol):
    """A door that listens (on `port`, from `listener`) until stopped."""

    port: int
    listener: socket.socket

    def url(self, host: str) -> str: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ReplicaDoorPlane:
    """What a replica's door serves from: its settings and the primary's door's listening
    socket (inherited), its metrics, selection and limits (those of its gRPC server), its
    readiness, and the channel to the primary's private server (for what only the primary
    knows)."""

    settings: Settings
    listener: socket.socket
    metrics: Metrics
    selection: SelectionServicer
    limits: Limits
    ready: Callable[[], bool]
    channel: Any


#: Opens a replica's door.
ReplicaDoorFactory = Callable[[ReplicaDoorPlane], Awaitable[OpenDoor]]
