"""One worker incarnation's life at the edges: started, greeted, reaped.

`spawn` starts `python -m service.worker --device D` with a pipe of ours for its answers
(read by `reader.AnswerReader`), `handshake` waits for its hello (the platform profile), and
`reap` collects its exit status once it ended or must end. The worker handle runs these in
its supervision loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from service.ipc import protocol
from service.ipc.errors import ProtocolError
from service.oracle import InvalidSpecError, PlatformProfile
from service.pool.config import SupervisorConfig
from service.pool.errors import WorkerDiedError
from service.pool.reader import AnswerReader

#: Seconds a worker that closed its answer pipe (or is told to stop) has to exit by itself.
EXIT_WAIT_S = 5.0


async def spawn(
    device: str, config: SupervisorConfig, on_line: Callable[[bytes], None]
) -> tuple[asyncio.subprocess.Process, AnswerReader]:
    """Start an incarnation; its stdout is a pipe of ours read by `AnswerReader`."""
    read_fd, write_fd = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service.worker",
            "--device",
            device,
            "--log-format",
            config.log_format,
            "--log-level",
            config.log_level,
            stdin=asyncio.subprocess.PIPE,
            stdout=write_fd,
            env={**os.environ, **config.worker_env},
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return process, AnswerReader(read_fd, on_line)


async def handshake(
    reader: AnswerReader, timeout_s: float
) -> tuple[dict[str, Any], PlatformProfile]:
    """The worker's hello: its info and platform profile (WorkerDiedError without one)."""
    done, _ = await asyncio.wait(
        (reader.hello, reader.closed),
        timeout=timeout_s,
        return_when=asyncio.FIRST_COMPLETED,
    )
    if not done:
        raise WorkerDiedError(f"no hello within {timeout_s:g} s")
    if not reader.hello.done():
        failure = reader.closed.result()
        raise WorkerDiedError(f"bad hello: {failure}" if failure else "exited before its hello")
    try:
        message = protocol.decode(reader.hello.result())
        if message.get("event") != "hello" or not isinstance(message.get("info"), dict):
            raise ProtocolError("the first message must be a hello")
        info: dict[str, Any] = message["info"]
        profile = PlatformProfile.from_json(info.get("platform") or {})
    except (ProtocolError, InvalidSpecError) as exc:
        raise WorkerDiedError(f"bad hello: {exc}") from None
    return info, profile


async def reap(process: asyncio.subprocess.Process, *, hung: bool) -> None:
    """Collect the incarnation's exit status, killing it if it is (or may be) alive.

    A worker that closed its stdout is normally dead already: wait for asyncio to reap it
    rather than kill() at once, because Popen.send_signal() polls first and would reap it
    itself, losing the exit status ("killed by SIGKILL") to a blind 255."""
    if process.returncode is None and not hung:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), timeout=EXIT_WAIT_S)
    if process.returncode is None:
        process.kill()
    await process.wait()


async def stop(process: asyncio.subprocess.Process) -> None:
    """End a running incarnation: close its stdin (it exits by itself), kill it if not."""
    if process.returncode is not None:
        return
    if process.stdin is not None:
        process.stdin.close()
    try:
        await asyncio.wait_for(process.wait(), timeout=EXIT_WAIT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
