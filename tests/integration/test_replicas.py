"""Several server processes on one port (`--server-processes`): connections reach every
process, every RPC works from each (worker RPCs forwarded to the primary), /metrics sums
all processes, readiness and shutdown move together, a killed replica comes back."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from integration.serverproc import SERVICE, ServerProcess, health_status, wait_for
from integration.test_lifecycle import next_status, watch_readiness
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc

Factory = Callable[..., ServerProcess]
SPEC = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": False,
    },
    "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336},
    "platform": "a100",
}
#: What a replica runs.
REPLICA_ENTRY = re.compile(rb"-m\x00service\.server\.replica\x00")
#: Connections opened per test: all landing on one of two processes has odds 2**-15.
CONNECTIONS = 16


def replica_pids(server: ServerProcess) -> list[int]:
    """The server's replica processes (its children running a replica module)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == server.process.pid and REPLICA_ENTRY.search(cmdline):
            pids.append(int(entry.name))
    return sorted(pids)


def established_on(pid: int, port: int) -> int:
    """TCP connections to `port` that process `pid` holds (accepted by it)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


@contextmanager
def channels(server: ServerProcess, count: int = CONNECTIONS) -> Iterator[list[grpc.Channel]]:
    """`count` separate connections (no subchannel sharing)."""
    with ExitStack() as stack:
        opened = [
            stack.enter_context(
                grpc.insecure_channel(
                    server.address, options=[("grpc.use_local_subchannel_pool", 1)]
                )
            )
            for _ in range(count)
        ]
        for channel in opened:
            grpc.channel_ready_future(channel).result(timeout=10)
        yield opened


def scrape(server: ServerProcess) -> str:
    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        return str(response.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_process_serves_every_rpc_and_metrics_sum_them(server_factory: Factory) -> None:
    server = server_factory("--server-processes", "2")
    replicas = replica_pids(server)
    assert len(replicas) == 1
    request = pb.SelectBackendRequest(spec_json=json.dumps(SPEC))
    with channels(server) as opened:
        for channel in opened:
            stub = pb_grpc.MoeControlServiceStub(channel)
            assert stub.SelectBackend(request, timeout=5).backend == "MARLIN"
            assert stub.ListPlatformPresets(pb.ListPlatformPresetsRequest(), timeout=5).presets
            assert stub.ListRulesets(pb.ListRulesetsRequest(), timeout=5).rulesets
            workers = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)  # forwarded
            assert workers.ready and workers.workers[0].pid > 0
            try:
                stub.GetPlatform(pb.GetPlatformRequest(worker_index=7), timeout=5)
                raise AssertionError("worker 7 should not exist")
            except grpc.RpcError as error:
                call: Any = error
                assert call.code() is grpc.StatusCode.NOT_FOUND
                status = rpc_status.from_call(call)
                assert status is not None
                info = error_details_pb2.ResourceInfo()
                assert status.details[0].Unpack(info) and info.resource_name == "7"
        assert established_on(server.process.pid, server.port) > 0
        assert established_on(replicas[0], server.port) > 0, "no connection reached the replica"
    text = scrape(server)
    method = {"grpc_service": SERVICE, "grpc_type": "unary"}
    handled = "grpc_server_handled_total"
    n = float(CONNECTIONS)
    assert sample(text, handled, grpc_method="SelectBackend", grpc_code="OK", **method) == n
    assert sample(text, handled, grpc_method="ListWorkers", grpc_code="OK", **method) == n
    assert sample(text, handled, grpc_method="GetPlatform", grpc_code="NOT_FOUND", **method) == n
    selections = sample(
        text, "moe_control_backend_selections_total", backend="MARLIN", integration="auto_gptq"
    )
    assert selections == n
    assert sample(text, "moe_control_worker_ready", worker="0") == 1
    assert sample(text, "moe_control_build_info") == 1


def test_readiness_and_shutdown_move_every_process(server_factory: Factory) -> None:
    server = server_factory("--server-processes", "2", "--worker-restart-backoff-s", "0.5")
    replicas = replica_pids(server)
    with channels(server, 8) as opened:
        watches = [watch_readiness(channel)[0] for channel in opened]
        assert {next_status(w) for w in watches} == {"SERVING"}
        stub = pb_grpc.MoeControlServiceStub(opened[0])
        worker = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        assert {next_status(w) for w in watches} == {"NOT_SERVING"}
        assert {next_status(w) for w in watches} == {"SERVING"}
        server.process.send_signal(signal.SIGTERM)
        assert {next_status(w) for w in watches} <= {"NOT_SERVING", "<closed>"}
        assert server.process.wait(timeout=20) == 0
    assert wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in replicas), 5)


def test_a_killed_replica_is_restarted(server_factory: Factory) -> None:
    server = server_factory("--server-processes", "2", "--worker-restart-backoff-s", "0.2")
    (first,) = replica_pids(server)
    os.kill(first, signal.SIGKILL)
    assert wait_for(lambda: replica_pids(server) not in ([], [first]), 15)
    (second,) = replica_pids(server)
    request = pb.SelectBackendRequest(spec_json=json.dumps(SPEC))

    def new_replica_serves() -> bool:
        with channels(server) as opened:
            for channel in opened:
                stub = pb_grpc.MoeControlServiceStub(channel)
                assert stub.SelectBackend(request, timeout=5).backend == "MARLIN"
            return established_on(second, server.port) > 0

    assert wait_for(new_replica_serves, 15, interval=0.2)
    with channels(server) as opened:
        assert wait_for(lambda: {health_status(c, SERVICE) for c in opened} == {"SERVING"}, 10)
    events = [json.loads(line).get("event") for line in server.stderr_lines if line.startswith("{")]
    assert "replica_restart" in events
