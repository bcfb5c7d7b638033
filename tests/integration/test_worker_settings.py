"""The settings a worker reads reach it from `serve`'s flags: the server starts each worker
with them in its environment (`Settings.worker_environ`), read there back as settings."""

from __future__ import annotations

from pathlib import Path

from integration.serverproc import launch, wait_ready
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.settings import worker_setting


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_flags_to_serve_reach_the_workers(tmp_path: Path) -> None:
    library = tmp_path / "marlin.so"
    server = launch("--no-triton-decode", "--marlin-library", str(library))
    try:
        wait_ready(server)
        with server.channel() as channel:
            workers = pb_grpc.MoeControlServiceStub(channel).ListWorkers(
                pb.ListWorkersRequest(), timeout=30
            )
        pids = [w.pid for w in workers.workers]
        assert pids and all(pids)
        for pid in pids:
            env = _environ(pid)
            assert worker_setting("triton_decode", env) is False
            assert worker_setting("marlin_library", env) == library
    finally:
        server.stop()
