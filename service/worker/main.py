"""The worker process: `python -m service.worker --device cuda:0`.

It owns one device. Its stdout carries the JSON-lines protocol only (fd 1 is pointed at
stderr after the protocol stream is set aside, so a library that prints cannot corrupt it);
its logs go to stderr. It exits when its stdin closes (the server went away).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

from service.worker import probe, protocol

log = logging.getLogger("moe_control.worker")


class Worker:
    """The worker's request handlers (later releases add conversion and kernels)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.info = probe.probe(device)
        self.layers: dict[str, dict[str, Any]] = {}
        self.handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "ping": self.ping,
            "profile": self.profile,
            "list_layers": self.list_layers,
            "unload_layer": self.unload_layer,
        }

    def ping(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def profile(self, params: dict[str, Any]) -> dict[str, Any]:
        return self.info

    def list_layers(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"layers": list(self.layers.values())}

    def unload_layer(self, params: dict[str, Any]) -> dict[str, Any]:
        layer = self.layers.pop(str(params.get("layer_id", "")), None)
        return {
            "found": layer is not None,
            "freed_bytes": 0 if layer is None else layer["byte_size"],
        }

    def handle(self, line: bytes) -> bytes:
        try:
            message = protocol.decode(line)
        except protocol.ProtocolError as exc:
            return protocol.error(-1, "ProtocolError", str(exc))
        call_id = message.get("id")
        if not isinstance(call_id, int):
            return protocol.error(-1, "ProtocolError", "a request needs an integer id")
        handler = self.handlers.get(str(message.get("method")))
        if handler is None:
            return protocol.error(call_id, "UnknownMethod", f"no method {message.get('method')!r}")
        params = message.get("params") or {}
        try:
            return protocol.result(call_id, handler(params))
        except Exception as exc:
            log.exception("worker call %s failed", message.get("method"))
            return protocol.error(call_id, type(exc).__name__, str(exc))


def serve(device: str, stdin: BinaryIO, stdout: BinaryIO) -> int:
    worker = Worker(device)
    stdout.write(protocol.hello(worker.info))
    stdout.flush()
    log.info("worker ready", extra={"device": device, "platform": worker.info.get("platform")})
    for line in stdin:
        stdout.write(worker.handle(line))
        stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.worker")
    parser.add_argument("--device", default="cpu", help="device to own: cpu, cuda:N, xpu:N")
    parser.add_argument(
        "--list-devices", action="store_true", help="print the visible devices as JSON and exit"
    )
    parser.add_argument("--log-format", default="json", choices=("json", "text"))
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    from service.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    if args.list_devices:
        print(json.dumps(probe.visible_devices()))
        return 0
    # Ctrl-C in a terminal reaches the whole process group; the server decides when the
    # worker ends (it closes stdin, then terminates it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Keep the protocol stream to ourselves: whatever else writes to fd 1 lands on stderr.
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        return serve(args.device, sys.stdin.buffer, proto_out)
    except BrokenPipeError:
        return 0
