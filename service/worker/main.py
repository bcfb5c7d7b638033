"""The worker process: `python -m service.worker --device cuda:0`.

It owns one device. Its stdout carries the JSON-lines protocol only (fd 1 is pointed at
stderr after the protocol stream is set aside, so a library that prints cannot corrupt it);
its logs go to stderr. It exits when its stdin closes (the server went away).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from service.formats.errors import ConversionUnsupported
from service.ipc import protocol
from service.ipc.errors import ProtocolError
from service.worker import jobs, probe
from service.worker.context import Job
from service.worker.layers import LayerStore

if TYPE_CHECKING:
    from service.worker.streams import Streams
    from service.worker.transport import Transport

log = logging.getLogger("moe_control.worker")

#: Background methods (they run on job threads; see jobs.py): method -> "module:function",
#: imported on first use so a worker that never converts never imports torch for it.
BACKGROUND: dict[str, str] = {
    "convert_layer": "service.worker.convert:convert_layer",
    "convert_checkpoint": "service.worker.convert:convert_checkpoint",
    "run_moe": "service.worker.run:run_moe",
    "measure_backends": "service.worker.measure:measure_backends",
}


class Worker:
    """The worker's request handlers: quick ones answer inline, long ones run as jobs."""

    def __init__(self, device: str, send: Callable[[bytes], None] | None = None) -> None:
        self.device = device
        self.info = probe.probe(device)
        self.layers = LayerStore()
        self.jobs = jobs.Jobs(send or (lambda line: None))
        self._lazy_lock = threading.Lock()
        self._streams: Streams | None = None
        self._transport: Transport | None = None
        self._kernels: dict[str, Any] | None = None
        self._background: dict[str, tuple[jobs.Handler, str]] = {}
        self.handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "ping": self.ping,
            "profile": self.profile,
            "list_layers": self.list_layers,
            "unload_layer": self.unload_layer,
            "cancel": self.cancel,
            "check_target": self.check_target,
        }

    @property
    def streams(self) -> Streams:
        """One CUDA stream per request class (streams.py); made on first use (torch)."""
        with self._lazy_lock:
            if self._streams is None:
                from service.worker.streams import Streams

                self._streams = Streams(self.device)
            return self._streams

    @property
    def transport(self) -> Transport:
        """Segment <-> device copies through pinned staging (transport.py)."""
        with self._lazy_lock:
            if self._transport is None:
                from service.worker.transport import Transport

                self._transport = Transport(self.device)
            return self._transport

    def background(self, method: str) -> jobs.Handler:
        """The job for `method`, run on its request class's stream (streams.py)."""
        return self.job(method)[0]

    def job(self, method: str) -> tuple[jobs.Handler, str]:
        """`background(method)` and its request class (which kept job threads run it:
        jobs.py). Made once per method: the import and lookup are not paid per call."""
        found = self._background.get(method)
        if found is not None:
            return found
        module_name, _, function = BACKGROUND[method].partition(":")
        target: Job = getattr(importlib.import_module(module_name), function)
        from service.worker.streams import request_class

        kind = request_class(method)

        def handler(params: dict[str, Any], context: jobs.JobContext) -> dict[str, Any]:
            with self.streams.scope(kind):
                result: dict[str, Any] = target(self, params, context)
            return result

        self._background[method] = handler, kind
        return handler, kind

    def check_target(self, params: dict[str, Any]) -> dict[str, Any]:
        """Whether this worker can write a backend's layout (asked before data moves)."""
        from service.formats import registry

        try:
            registry.writer_for(str(params.get("backend", "")))
        except ConversionUnsupported as exc:
            return {"supported": False, "reason": exc.reason}
        return {"supported": True}

    def cancel(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"cancelled": self.jobs.cancel(int(params.get("call_id", -1)))}

    def ping(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def profile(self, params: dict[str, Any]) -> dict[str, Any]:
        """The hello's profile plus `kernels`: each backend's availability on this device
        (worked out on the first call: it imports torch and loads vLLM's Marlin library)."""
        if self._kernels is None:
            import torch

            from service.worker.run import kernel_status

            self._kernels = kernel_status(torch.device(self.device))
        return {**self.info, "kernels": self._kernels}

    def list_layers(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"layers": self.layers.infos()}

    def unload_layer(self, params: dict[str, Any]) -> dict[str, Any]:
        layer = self.layers.pop(str(params.get("layer_id", "")))
        return {
            "found": layer is not None,
            "freed_bytes": 0 if layer is None else int(layer.info.get("byte_size", 0)),
        }

    def handle(self, line: bytes) -> bytes | None:
        """The answer to one request line; None when it started a background job (which
        answers by itself when it ends)."""
        try:
            message = protocol.decode(line)
        except ProtocolError as exc:
            return protocol.error(-1, "ProtocolError", str(exc))
        call_id = message.get("id")
        if not isinstance(call_id, int):
            return protocol.error(-1, "ProtocolError", "a request needs an integer id")
        method = str(message.get("method"))
        params = message.get("params") or {}
        if method in BACKGROUND:
            try:
                job, kind = self.job(method)
                self.jobs.start(call_id, method, job, params, kind=kind)
            except Exception as exc:
                log.exception("cannot start %s", method)
                return protocol.error(call_id, *jobs.describe(exc))
            return None
        handler = self.handlers.get(method)
        if handler is None:
            return protocol.error(call_id, "UnknownMethod", f"no method {message.get('method')!r}")
        try:
            return protocol.result(call_id, handler(params))
        except Exception as exc:
            log.exception("worker call %s failed", message.get("method"))
            return protocol.error(call_id, type(exc).__name__, str(exc))


def serve(device: str, stdin: BinaryIO, stdout: BinaryIO) -> int:
    lock = threading.Lock()
    fd = stdout.fileno()

    def send(line: bytes) -> None:
        """Write one protocol line (background jobs write from their own threads): straight
        to the pipe's descriptor, one write for a line that fits the pipe, no buffer to copy
        into and flush."""
        with lock:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]

    worker = Worker(device, send)
    send(protocol.hello(worker.info))
    log.info("worker ready", extra={"device": device, "platform": worker.info.get("platform")})
    try:
        for line in stdin:
            answer = worker.handle(line)
            if answer is not None:
                send(answer)
    finally:
        worker.jobs.cancel_all()
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
    # Before any thread starts: glibc's defaults let the heap grow under load (memory.py).
    from service.process import tune_malloc

    tune_malloc()
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
