"""The serving worker's own platform, and what vLLM (the local oracle) answers on it.

A CPU worker's platform is probed from the real CPU (service/worker/probe.py): with AMX
(amx_tile and amx_bf16) vLLM 0.33 gives a WNA16 layer its CPU backend, without AMX it selects
nothing. Tests that leave the platform to the worker derive their expected answer here, from
the platform the worker reports, so they hold on both kinds of host; failure paths that only
exist without AMX are reproduced with `NO_AMX_CPU` where the RPC takes a what-if platform.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from integration.serverproc import ServerProcess
from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.oracle import Decision, SelectionError, Verdict, select

#: An x86 CPU without AMX, with vLLM's CPU build (triton-cpu, which 0.34 requires on x86) and
#: no optional kernel package: vLLM has no WNA16 MoE backend for it (ZEN_CPU needs zentorch,
#: CPU needs AMX), whatever this host's CPU is.
NO_AMX_CPU: dict[str, Any] = {"device": "cpu", "amx": False, "x86": True, "packages": ["triton"]}

#: A spec field that makes vLLM 0.33 fail on every CPU: Marlin needs a CUDA device. MEASURED
#: takes no what-if platform, so this is how its failure path is reached on any host.
FORCED_MARLIN: dict[str, Any] = {"moe_backend": "marlin"}


def worker_platform(stub: Any, index: int = 0) -> dict[str, Any]:
    """Worker `index`'s platform as it reports it over GetPlatform (PlatformProfile JSON)."""
    answer = stub.GetPlatform(pb.GetPlatformRequest(worker_index=index), timeout=5)
    return codec.platform_to_json(answer.worker.platform)


def server_worker_platform(server: ServerProcess, index: int = 0) -> dict[str, Any]:
    with server.channel() as channel:
        return worker_platform(pb_grpc.MoeControlServiceStub(channel), index)


def oracle_on(spec: Mapping[str, Any], platform: Any) -> Decision | SelectionError:
    """vLLM's answer for `spec` on `platform` (a profile or a preset name): the decision,
    or the SelectionError vLLM fails with."""
    try:
        return select({**spec, "platform": platform})
    except SelectionError as exc:
        return exc


def rejected(answer: Decision | SelectionError) -> int:
    """How many backends the answer rejects (what moe_control_backend_rejections_total
    counts for it)."""
    return sum(c.verdict == Verdict.REJECTED for c in answer.candidates)
