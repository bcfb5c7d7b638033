"""`python -m service.cli.replica`: a replica server process of `moe-control serve` with
the HTTP/JSON door (service.server.replica serves gRPC; the door is service.http's, opened
here because the server's floor cannot import it)."""

from __future__ import annotations

import sys

from service.server.doors import OpenDoor, ReplicaDoorPlane
from service.server.replica import main


async def open_http(plane: ReplicaDoorPlane) -> OpenDoor:
    """The door on the replica's selection and limits, the primary's state asked of its
    private server, on the primary's door's listening socket."""
    from service.http.serve import open_http as open_door
    from service.http.state import ForwardedState

    return await open_door(
        plane.settings,
        metrics=plane.metrics,
        selection=plane.selection,
        state=ForwardedState(plane.channel, plane.settings.token()),
        ready=plane.ready,
        limits=plane.limits,
        sock=plane.listener,
    )


if __name__ == "__main__":
    sys.exit(main(open_http))
