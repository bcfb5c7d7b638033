"""The errors the clients raise (beyond grpc.RpcError, which they pass on as the server
answered)."""

from __future__ import annotations

import json
from typing import Any

import grpc

from service.errors import MoeControlError


class RemoteSelectionError(MoeControlError):
    """A SelectBackend call failed; `result` is what the CLI prints, `exit_code` its status."""

    def __init__(self, code: grpc.StatusCode, result: dict[str, Any], exit_code: int) -> None:
        self.code = code
        self.result = result
        self.exit_code = exit_code
        super().__init__(f"{code.name}: {json.dumps(result)}")


class ServerNotReadyError(MoeControlError):
    """A client waited for the server's readiness (`--wait-ready`) and the time ran out;
    `last` is the last health status it saw (or why it saw none)."""

    def __init__(self, service: str, last: str, waited_s: float) -> None:
        self.service = service
        self.last = last
        self.waited_s = waited_s
        super().__init__(
            f"not ready after {waited_s:.1f} s: health of {service or 'the server'} is {last}"
        )


class LayerNotHeldError(MoeControlError):
    """No worker holds the layer asked for; the message lists those that are held."""
