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
