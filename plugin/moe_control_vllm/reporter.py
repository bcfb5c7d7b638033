"""Sending reports without ever holding vLLM up: a background thread, a bounded queue, a
deadline per call, one warning line for the first failure.

`Reporter.submit` is all vLLM's thread ever does: a non-blocking put on a bounded queue
(a full queue drops the report). The sending thread starts with the first report, imports
grpc and protobuf there (not on vLLM's path), builds the wire messages of what is queued,
in batches, and calls ReportDecisions by name under `deadline_s`, retrying a call the
server may answer later (UNAVAILABLE, a deadline) twice; anything else (a wrong token, a
server without the method) is not retried. The first failure of any kind is one warning
line; later ones are counted, not logged. A forked child
(vLLM's workers may be forked) starts with a fresh queue and thread of its own. The thread
waits `FIRST_SEND_DELAY_S` before its first send, so that its imports do not compete with
vLLM's layer building for the GIL. At exit, what is still queued gets at most
`FLUSH_AT_EXIT_S` to leave.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from moe_control_vllm.record import Decision, Process
from moe_control_vllm.settings import ReportSettings

log = logging.getLogger("moe_control_vllm")

#: Reports waiting to leave, at most; more are dropped.
QUEUE_SIZE = 256
#: Decisions one call carries, at most (the server's own batch limit).
BATCH = 64
#: How long the thread waits for more reports to join a batch.
COALESCE_S = 0.05
#: Waits before the second and third attempt of a call the server may answer later.
RETRY_DELAYS_S = (1.0, 4.0)
#: What is still queued at exit gets this long to leave.
FLUSH_AT_EXIT_S = 1.0
#: The sending thread waits this long after the first report before it imports grpc and
#: sends (or until a flush asks): vLLM is usually still building its layers then, and the
#: import would take the GIL from it.
FIRST_SEND_DELAY_S = 2.0
METHOD = "/moe_control.v1.MoeControlService/ReportDecisions"
_RETRIED = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})


class Reporter:
    """Reports `ObservedDecision`s to one server from a background thread."""

    def __init__(
        self,
        settings: ReportSettings,
        process: Callable[[], Process],
    ) -> None:
        self.settings = settings
        self._process = process
        self._lock = threading.Lock()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)
        atexit.register(self.flush, FLUSH_AT_EXIT_S)

    def _reset(self) -> None:
        self._queue: queue.Queue[Decision] = queue.Queue(QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._warned = False
        #: Decisions the server accepted, dropped (queue full) and failed to report.
        self.sent = 0
        self.dropped = 0
        self.failed = 0
        #: CPU seconds the sending thread used (its imports included): under the GIL, at
        #: most this much is taken from vLLM's threads, in the background.
        self.cpu_s = 0.0

    # -- vLLM's side: never blocks

    def submit(self, decision: Decision) -> None:
        try:
            self._queue.put_nowait(decision)
        except queue.Full:
            self.dropped += 1
            self._warn_once(f"its queue of {QUEUE_SIZE} reports is full; dropping reports")
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="moe-control-report", daemon=True
                    )
                    self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every queued report to be sent or given up;
        whether the queue is done."""
        end = time.monotonic() + timeout
        self._wake.set()
        while self._queue.unfinished_tasks:
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    # -- the sending thread

    def _run(self) -> None:
        self._wake.wait(FIRST_SEND_DELAY_S)
        try:
            call = self._open()
        except Exception as exc:  # no grpc, a bad certificate file: reporting stays off
            self._warn_once(f"it cannot open a channel ({exc})")
            call = None
        while True:
            batch = [self._queue.get()]
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get(timeout=COALESCE_S))
                except queue.Empty:
                    break
            try:
                if call is None:
                    self.failed += len(batch)
                else:
                    self._send(call, batch)
            except Exception as exc:  # never let the thread die on a report
                self.failed += len(batch)
                self._warn_once(f"a report failed ({type(exc).__name__}: {exc})")
            finally:
                self.cpu_s = time.thread_time()
                for _ in batch:
                    self._queue.task_done()

    def _open(self) -> Any:
        import grpc

        from moe_control_vllm.generated.moe_control.v1 import observed_pb2

        s = self.settings
        if s.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=None if s.tls_ca is None else s.tls_ca.read_bytes(),
                private_key=None if s.tls_key is None else s.tls_key.read_bytes(),
                certificate_chain=None if s.tls_cert is None else s.tls_cert.read_bytes(),
            )
            channel = grpc.secure_channel(s.address, credentials)
        else:
            channel = grpc.insecure_channel(s.address)
        return channel.unary_unary(
            METHOD,
            request_serializer=observed_pb2.ReportDecisionsRequest.SerializeToString,
            response_deserializer=observed_pb2.ReportDecisionsResponse.FromString,
        )

    def _send(self, call: Any, batch: list[Decision]) -> None:
        import grpc

        from moe_control_vllm.messages import report_request

        request = report_request(self._process(), batch)
        metadata = (
            (("authorization", f"Bearer {self.settings.token}"),) if self.settings.token else ()
        )
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            try:
                call(request, timeout=self.settings.deadline_s, metadata=metadata)
                self.sent += len(batch)
                return
            except grpc.RpcError as error:
                failure: Any = error
                code = failure.code().name
                if code not in _RETRIED or attempt == len(RETRY_DELAYS_S):
                    self.failed += len(batch)
                    self._warn_once(f"the server answered {code}: {failure.details()}")
                    return
                time.sleep(RETRY_DELAYS_S[attempt])

    def _warn_once(self, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning(
            "moe-control: cannot report WNA16 MoE decisions to %s: %s; vLLM is not affected "
            "and later failures are not logged",
            self.settings.address,
            why,
        )
