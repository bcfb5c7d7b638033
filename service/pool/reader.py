"""Reading a worker's answer pipe inside the event loop.

Each complete line is handled in the loop's readiness callback for the pipe, where it was
read, so the task waiting for that answer is the only one woken. asyncio's subprocess stream
instead fed a StreamReader whose reader task the loop then had to wake, one more pass of the
loop per answer.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from service.ipc import protocol

#: Most bytes read from a worker's answer pipe at once (asyncio's own pipe reads: 256 KiB).
READ_BYTES = 256 * 1024


class AnswerReader:
    """The read end of a worker's stdout pipe, read in the event loop's readiness callback
    (`loop.add_reader`). The first line fills `hello`, the others go to `on_line`; `closed`
    gets why reading ended ("" at end of file, the worker gone)."""

    def __init__(self, fd: int, on_line: Callable[[bytes], None]) -> None:
        self._fd = fd
        self._on_line = on_line
        self._partial = b""
        self._loop = asyncio.get_running_loop()
        self.hello: asyncio.Future[bytes] = self._loop.create_future()
        self.closed: asyncio.Future[str] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(f"cannot read its answers: {exc}")
            return
        if not data:
            self._close("")
            return
        lines = (self._partial + data).split(b"\n") if self._partial else data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > protocol.MAX_LINE_BYTES:
            self._close(f"protocol error: a line longer than {protocol.MAX_LINE_BYTES} bytes")
            return
        for line in lines:
            if self.closed.done():
                return
            if not self.hello.done():
                self.hello.set_result(line)
                continue
            try:
                self._on_line(line)
            except Exception as exc:  # a protocol error or a failing listener: worker is lost
                self._close(str(exc) or type(exc).__name__)
                return

    def _close(self, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result(reason)
        self.close()

    def close(self) -> None:
        """Stop reading and close the pipe (idempotent)."""
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if not self.closed.done():
            self.closed.set_result("")
