"""How the server reads a worker's answers: lines off the pipe in the loop's own callback,
and the late answer of a call whose caller left.

Why: `AnswerReader` replaced asyncio's stream and reader task (one pass of the event loop
less per answer), so it now owns line framing, the line limit and end of file; and the
answer's future is awaited without `asyncio.shield`, so an abandoned call's answer reaches
`on_abandon` through the handle's registry instead of the shielded future.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from worker.test_convert_job import params, put_inputs

from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.quantize import random_layer
from service.ipc import codec, protocol
from service.ipc.messages import ConvertLayer, LayerConverted
from service.ipc.segments import SegmentDir
from service.pool.config import SupervisorConfig
from service.pool.pool import WorkerPool
from service.pool.reader import AnswerReader

FAST = SupervisorConfig(ping_interval_s=0.2, ping_timeout_s=30.0, restart_backoff_s=0.05)


async def read_all(chunks: list[bytes]) -> tuple[bytes, list[bytes], str]:
    """Write `chunks` into a pipe one by one, then close it; what the reader saw."""
    read_fd, write_fd = os.pipe()
    lines: list[bytes] = []
    reader = AnswerReader(read_fd, lines.append)
    try:
        for chunk in chunks:
            if reader.closed.done():
                break  # it stopped reading (and closed its end)
            os.write(write_fd, chunk)
            await asyncio.sleep(0.01)  # each chunk its own read
        os.close(write_fd)
        write_fd = -1
        reason = await asyncio.wait_for(reader.closed, 5)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
        reader.close()
    return await reader.hello, lines, reason


def test_lines_are_framed_across_and_within_reads() -> None:
    hello, lines, reason = asyncio.run(
        read_all([b'{"event":"hello"}\n{"id":1}\n{"id"', b":2}", b"\n{}\n"])
    )
    assert hello == b'{"event":"hello"}'
    assert lines == [b'{"id":1}', b'{"id":2}', b"{}"]
    assert reason == ""  # end of file: the worker went away


def test_a_line_over_the_limit_ends_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 16)
    hello, lines, reason = asyncio.run(read_all([b"{}\n", b"x" * 17, b"\n{}\n"]))
    assert hello == b"{}" and lines == []
    assert "protocol error" in reason and "16" in reason


def test_a_failing_line_handler_ends_reading() -> None:
    async def scenario() -> str:
        read_fd, write_fd = os.pipe()

        def refuse(line: bytes) -> None:
            raise ValueError(f"cannot take {line!r}")

        reader = AnswerReader(read_fd, refuse)
        try:
            os.write(write_fd, b"{}\nbad\nnever\n")
            return await asyncio.wait_for(reader.closed, 5)
        finally:
            os.close(write_fd)
            reader.close()

    assert asyncio.run(scenario()) == "cannot take b'bad'"


def test_an_abandoned_call_gets_its_late_answer_once(tmp_path: Path) -> None:
    """A call past its timeout is cancelled in the worker; whatever the worker answers
    (the kept layer, or the cancellation) reaches on_abandon exactly once, and a call left
    on a worker that then dies gets None."""
    layer = random_layer(
        2, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(1)
    )
    tensors = write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")

    async def scenario() -> tuple[list[LayerConverted | None], list[LayerConverted | None]]:
        pool = WorkerPool(["cpu"], FAST)
        pool.start()
        segments = SegmentDir.create(tmp_path)
        try:
            assert await pool.wait_ready(60)
            worker = pool.workers[0]
            values = params(segments, put_inputs(segments, tensors), keep_loaded=True)
            request = codec.from_json(ConvertLayer, values)
            late: list[LayerConverted | None] = []
            with pytest.raises(TimeoutError):
                await worker.call(request, timeout=1e-4, on_abandon=late.append)
            for _ in range(500):
                if late:
                    break
                await asyncio.sleep(0.02)
            # The worker kept the layer only if the job finished before the cancel came.
            kept = {info["layer_id"] for info in await pool.list_layers(0)}
            first = late[:]
            answer = first[0] if first else None
            assert (answer is None and not kept) or (answer and answer.layer_id in kept)

            stopped: list[LayerConverted | None] = []
            pid = pool.snapshots()[0].pid
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(TimeoutError):
                await worker.call(request, timeout=0.2, on_abandon=stopped.append)
            assert stopped == []  # still running as far as anyone knows
            os.kill(pid, signal.SIGKILL)
            for _ in range(500):
                if stopped:
                    break
                await asyncio.sleep(0.02)
            return late, stopped
        finally:
            segments.destroy()
            await pool.stop()

    late, stopped = asyncio.run(scenario())
    assert len(late) == 1
    assert stopped == [None]
