"""Every Prometheus collector of the service, in one place.

Names follow the Prometheus conventions (prefix `moe_control_`, base units, `_total` on
counters) and reuse the standard gRPC server names (`grpc_server_*`, as go-grpc-prometheus
and py-grpc-prometheus spell them) so existing dashboards and alerts work. Labels are bounded:
backends, reason codes, integrations, gRPC methods and codes, worker indices; never ids,
paths or shapes.

Each `Metrics` owns its own `CollectorRegistry`, so tests and several servers in one process
do not collide.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from importlib import metadata
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from service import __version__
from service.oracle import DEFAULT_RULESET, Candidate, Decision

#: From 100 µs (a SelectBackend answer) to 10 min (a whole-checkpoint conversion).
RPC_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    600.0,
)
#: Conversions: 10 ms .. 10 min.
CONVERT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Fused MoE forwards: 10 µs .. 1 s.
RUN_MOE_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

#: The backend label of a decision that builds no WNA16 method (layer left unquantized).
NO_BACKEND = "none"


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


class Metrics:
    """The service's collectors, registered on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # Label children resolved once (the label sets are small and bounded).
        self._selection_children: dict[tuple[str, str], Any] = {}
        self._rejection_children: dict[tuple[str, str], Any] = {}
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

        self.build_info = Gauge(
            "moe_control_build_info",
            "Always 1; the labels carry the versions of this server.",
            ["version", "python", "grpcio", "protobuf", "ruleset"],
            registry=r,
        )
        self.build_info.labels(
            __version__,
            platform.python_version(),
            _version("grpcio"),
            _version("protobuf"),
            DEFAULT_RULESET,
        ).set(1)

        # -- decisions
        self.backend_selections = Counter(
            "moe_control_backend_selections_total",
            "WNA16 MoE backend decisions, by chosen backend and vLLM integration "
            "(the resolved quantization method).",
            ["backend", "integration"],
            registry=r,
        )
        self.backend_rejections = Counter(
            "moe_control_backend_rejections_total",
            "Backends rejected while deciding, by backend and stable reason code.",
            ["backend", "reason"],
            registry=r,
        )

        # -- gRPC server (standard names)
        rpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter(
            "grpc_server_started_total", "RPCs started on the server.", rpc_labels, registry=r
        )
        self.grpc_handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by status code.",
            [*rpc_labels, "grpc_code"],
            registry=r,
        )
        self.grpc_handling_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from the start of an RPC to its status, as the server measures it.",
            rpc_labels,
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.grpc_msg_received = Counter(
            "grpc_server_msg_received_total",
            "Stream messages received by the server.",
            rpc_labels,
            registry=r,
        )
        self.grpc_msg_sent = Counter(
            "grpc_server_msg_sent_total",
            "Stream messages sent by the server.",
            rpc_labels,
            registry=r,
        )

        # -- workers
        self.worker_ready = Gauge(
            "moe_control_worker_ready",
            "1 while the worker process has reported its platform and answers, else 0.",
            ["worker", "device"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "moe_control_worker_restarts_total",
            "Worker processes restarted by the supervisor after they died or hung.",
            ["worker", "device"],
            registry=r,
        )

        # -- conversion and forward (filled by the ConvertWeights and RunMoE implementations)
        self.convert_bytes = Counter(
            "moe_control_convert_bytes_total",
            "Weight bytes converted, by target format and direction (in, out).",
            ["target_format", "direction"],
            registry=r,
        )
        self.convert_seconds = Histogram(
            "moe_control_convert_duration_seconds",
            "Duration of a weight conversion, by target format.",
            ["target_format"],
            buckets=CONVERT_BUCKETS,
            registry=r,
        )
        self.run_moe_seconds = Histogram(
            "moe_control_run_moe_duration_seconds",
            "Device time of one fused MoE forward, by backend.",
            ["backend"],
            buckets=RUN_MOE_BUCKETS,
            registry=r,
        )
        self.run_moe_tokens = Counter(
            "moe_control_run_moe_tokens_total",
            "Tokens through fused MoE forwards, by backend.",
            ["backend"],
            registry=r,
        )

    # -----------------------------------------------------------------------------------

    def count_rejections(self, candidates: Iterable[Candidate]) -> None:
        for candidate in candidates:
            if candidate.verdict == "rejected":
                self.backend_rejections.labels(
                    candidate.backend, candidate.reason_code or "UNSPECIFIED"
                ).inc()

    def count_decision(self, decision: Decision) -> None:
        self.backend_selections.labels(decision.backend or NO_BACKEND, decision.quantization).inc()
        self.count_rejections(decision.candidates)

    def set_worker_ready(self, worker: int, device: str, ready: bool) -> None:
        self.worker_ready.labels(str(worker), device).set(1 if ready else 0)

    def count_worker_restart(self, worker: int, device: str) -> None:
        self.worker_restarts.labels(str(worker), device).inc()

    def exposition(self) -> bytes:
        """The text exposition format of every collector (what /metrics serves)."""
        return generate_latest(self.registry)
