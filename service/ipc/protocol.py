"""The server <-> worker pipe protocol: one JSON object per line, UTF-8, nothing pickled.

Server to worker: `{"id": <int>, "method": <str>, "params": {...}}`.
Worker to server: `{"id": <int>, "result": {...}}` or
`{"id": <int>, "error": {"type": <str>, "message": <str>}}`, and once at start, before any
answer, `{"event": "hello", "info": {...}}` (the worker's device and platform profile).
Tensors never travel here: they go through segment files in shared memory (segments.py),
copied to and from a CUDA device through pinned staging (the worker's transport.py).
"""

from __future__ import annotations

import json
from typing import Any

from service.ipc.errors import ProtocolError

#: Longest line either side accepts; a longer one is a protocol error.
MAX_LINE_BYTES = 4 * 1024 * 1024


#: Made once: `json.dumps` with any non-default option builds a new encoder per call.
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def encode(message: dict[str, Any]) -> bytes:
    line = (_ENCODE(message) + "\n").encode()
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"message of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    return line


def decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message must be a JSON object")
    return message


def request(call_id: int, method: str, params: dict[str, Any] | None = None) -> bytes:
    return encode({"id": call_id, "method": method, "params": params or {}})


def result(call_id: int, value: dict[str, Any]) -> bytes:
    return encode({"id": call_id, "result": value})


def error(call_id: int, kind: str, message: str, details: dict[str, Any] | None = None) -> bytes:
    """An error answer; `details` (optional) lets the server rebuild a domain error, e.g.
    `{"category": "invalid_argument", "field": "tensors[w13_qweight].sha256"}`."""
    body: dict[str, Any] = {"type": kind, "message": message}
    if details:
        body["details"] = details
    return encode({"id": call_id, "error": body})


def event(call_id: int, name: str, data: dict[str, Any]) -> bytes:
    """A progress line of a background call, sent before its answer."""
    return encode({"id": call_id, "event": name, "data": data})


def hello(info: dict[str, Any]) -> bytes:
    return encode({"event": "hello", "info": info})
