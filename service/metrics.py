"""Every Prometheus collector of the service, in one place.

Names follow the Prometheus conventions (prefix `moe_control_`, base units, `_total` on
counters) and reuse the standard gRPC server names (`grpc_server_*`, as go-grpc-prometheus
and py-grpc-prometheus spell them) so existing dashboards and alerts work. Labels are bounded:
backends, reason codes, integrations, gRPC methods and codes, worker indices; never ids,
paths or shapes.

Every labelled series whose label values are known at start is created at zero with the
collectors (`Metrics.__init__`; the workers' when the pool is known, `prepare_workers`): a
fresh server's first scrape lists them, prometheus_client's multiprocess mode (which reports
only the series a process created) included, and `increase()` sees the first event. Each
list comes from its one source: the ruleset's backends and reason codes, the oracle's
integrations, stages and exception types, the methods the server registers.

Each `Metrics` owns its own `CollectorRegistry`, so tests and several servers in one process
do not collide. A server of several processes (`--server-processes`, replica.py) runs them in
prometheus_client's multiprocess mode: every process writes its values to files in one
directory, and the primary's /metrics sums them (`Metrics(multiprocess_dir=...)`), so a
counter says the same whichever process served the calls.
"""

from __future__ import annotations

import os
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
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector

from service import __version__
from service.oracle import (
    DEFAULT_RULESET,
    PLATFORM_PRESETS,
    RULESETS,
    Candidate,
    Decision,
    SelectionError,
    preset,
)
from service.oracle.errors import STAGES, VLLM_EXCEPTIONS
from service.oracle.observed import AGREEMENTS, COMPARED_FIELDS
from service.oracle.quantization import INTEGRATIONS

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
#: The platform label of a decision on a platform the request spelled out (not a preset).
EXPLICIT_PLATFORM = "explicit"
#: The platform label of a decision on a serving worker's own platform (the default one,
#: or a worker the request names).
WORKER_PLATFORM = "worker"
#: The reason label of a rejection without a code.
NO_REASON = "UNSPECIFIED"
#: The ruleset label of an observed decision from a vLLM release no ruleset answers for.
NO_RULESET = "none"
#: The label of a reported backend or integration this server does not know (reports come
#: from vLLM processes, so their values are bounded to the known ones here).
OTHER = "other"


def platform_label(requested: object) -> str:
    """The `platform` label of a decision whose request named `requested` (the spec's
    "platform" value; None: the serving worker's): a preset's own name for a preset (by
    name, or as {"preset": name}), else `explicit`. Only called after the spec parsed, so a
    name is a known preset."""
    if requested is None:
        return WORKER_PLATFORM
    if isinstance(requested, dict) and set(requested) == {"preset"}:
        requested = requested["preset"]
    if isinstance(requested, str):
        name = preset(requested).name
        return name if name is not None and name in PLATFORM_PRESETS else EXPLICIT_PLATFORM
    return EXPLICIT_PLATFORM


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def enable_multiprocess(directory: str) -> None:
    """Switch this process's prometheus_client to multiprocess mode (values in files under
    `directory`). Call it before any `Metrics` is built: the library picks the value class
    from the environment when it is imported, so it is picked again here."""
    os.environ[MULTIPROC_ENV] = directory
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


class Metrics:
    """The service's collectors, registered on one registry.

    With `multiprocess_dir` (and `enable_multiprocess` called first), `registry` serves the
    sum over every process writing to that directory, plus this process's own
    `process_*` / `python_*` collectors; the collectors themselves live on a registry of
    their own (served by nobody), as the library's multiprocess mode requires."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, multiprocess_dir: str | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = multiprocess_dir is not None
        # Label children resolved once (the label sets are small and bounded).
        self._selection_children: dict[tuple[str, str, str, str], Any] = {}
        self._rejection_children: dict[tuple[str, str], Any] = {}
        self._failure_children: dict[tuple[str, str], Any] = {}
        self._run_moe_children: dict[str, tuple[Any, Any]] = {}
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        if multiprocess_dir is not None:
            MultiProcessCollector(self.registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
            r = CollectorRegistry()
        else:
            r = self.registry

        self.build_info = Gauge(
            "moe_control_build_info",
            "Always 1; the labels carry the versions of this server.",
            ["version", "python", "grpcio", "protobuf", "ruleset"],
            registry=r,
            multiprocess_mode="max",
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
            "WNA16 MoE backend decisions, by chosen backend, vLLM integration (the resolved "
            "quantization method), platform (a preset's name, explicit, or worker) and ruleset.",
            ["backend", "integration", "platform", "ruleset"],
            registry=r,
        )
        self.backend_rejections = Counter(
            "moe_control_backend_rejections_total",
            "Backends rejected while deciding, by backend and stable reason code.",
            ["backend", "reason"],
            registry=r,
        )
        self.decision_failures = Counter(
            "moe_control_decision_failures_total",
            "Decisions vLLM itself would refuse, by stage of its start-up path and vLLM's "
            "exception type.",
            ["stage", "error"],
            registry=r,
        )

        # -- fleet truth: what vLLM processes reported (ReportDecisions)
        self.observed_decisions = Counter(
            "moe_control_observed_decisions_total",
            "WNA16 MoE decisions vLLM processes reported taking (one per distinct decision "
            "per process), by the backend vLLM chose (none: it raised), vLLM integration and "
            "the ruleset the server compared them with (none: the release has no ruleset).",
            ["backend", "integration", "ruleset"],
            registry=r,
        )
        self.prediction_mismatches = Counter(
            "moe_control_prediction_mismatches_total",
            "Reported decisions of a release a ruleset models where the server's own answer "
            "for the same deployment differs from what vLLM did, by ruleset and the first "
            "field that differs.",
            ["ruleset", "field"],
            registry=r,
        )
        self.unmodelled_releases = Counter(
            "moe_control_observed_unmodelled_releases_total",
            "Reported decisions of a vLLM release no ruleset models (newer than every "
            "ruleset, between two, a pre-release or development build), by the ruleset the "
            "server compared them with (the nearest older one; none: no ruleset is as old) "
            "and outcome (agrees, differs, not_compared).",
            ["ruleset", "outcome"],
            registry=r,
        )
        self._known_backends = frozenset(
            backend for ruleset in RULESETS.values() for backend in ruleset.backends
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

        self.rpc_limited = Counter(
            "moe_control_rpc_limited_total",
            "Calls refused with RESOURCE_EXHAUSTED because their method's concurrency limit "
            "was reached, by method and limit (the setting).",
            ["grpc_method", "limit"],
            registry=r,
        )

        # -- HTTP/JSON API (service/http): requests by route template and HTTP status code
        self.http_requests = Counter(
            "moe_control_http_requests_total",
            "HTTP/JSON API requests answered, by method, route (the template, e.g. "
            "/v1/select) and HTTP status code.",
            ["method", "route", "code"],
            registry=r,
        )
        self.http_request_seconds = Histogram(
            "moe_control_http_request_duration_seconds",
            "Time from an HTTP/JSON API request's arrival to its answer, by method and route.",
            ["method", "route"],
            buckets=RPC_BUCKETS,
            registry=r,
        )

        # -- workers
        self.worker_ready = Gauge(
            "moe_control_worker_ready",
            "1 while the worker process has reported its platform and answers, else 0.",
            ["worker", "device"],
            registry=r,
            multiprocess_mode="mostrecent",
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
        self._prepare_decisions()

    def _prepare_decisions(self) -> None:
        """Create every decision series at zero: selections on the serving worker's own
        platform for each ruleset's backends (and `none`) and each integration; rejections
        for each ruleset's backends and reason codes; failures for each stage and vLLM
        exception type. Selections on presets and explicit platforms (what-if answers)
        appear with their first use: per preset, they would multiply the series by the
        number of presets."""
        for ruleset in RULESETS.values():
            for backend in (*ruleset.backends, NO_BACKEND):
                for integration in INTEGRATIONS:
                    self._selection_child(backend, integration, WORKER_PLATFORM, ruleset.name)
            for backend in ruleset.backends:
                for reason in ruleset.reason_codes:
                    self._rejection_child(backend, reason)
        for stage in STAGES:
            for error in VLLM_EXCEPTIONS:
                self._failure_child(stage, error)
        for ruleset in RULESETS.values():
            for backend in (*ruleset.backends, NO_BACKEND):
                for integration in INTEGRATIONS:
                    self.observed_decisions.labels(backend, integration, ruleset.name)
            for name in COMPARED_FIELDS:
                self.prediction_mismatches.labels(ruleset.name, name)
        for ruleset_label in (*RULESETS, NO_RULESET):
            for agreement in AGREEMENTS:
                self.unmodelled_releases.labels(ruleset_label, agreement)

    def _selection_child(self, backend: str, integration: str, platform: str, ruleset: str) -> Any:
        key = (backend, integration, platform, ruleset)
        child = self._selection_children.get(key)
        if child is None:
            child = self._selection_children[key] = self.backend_selections.labels(*key)
        return child

    def _rejection_child(self, backend: str, reason: str) -> Any:
        key = (backend, reason)
        child = self._rejection_children.get(key)
        if child is None:
            child = self._rejection_children[key] = self.backend_rejections.labels(*key)
        return child

    def _failure_child(self, stage: str, error: str) -> Any:
        key = (stage, error)
        child = self._failure_children.get(key)
        if child is None:
            child = self._failure_children[key] = self.decision_failures.labels(*key)
        return child

    def prepare_kernels(self, backends: Iterable[str]) -> None:
        """Create the conversion and forward series of each backend a worker has kernels
        (and writers) for: bytes in and out, durations, tokens."""
        for backend in backends:
            self.convert_bytes.labels(backend, "in")
            self.convert_bytes.labels(backend, "out")
            self.convert_seconds.labels(backend)
            self.run_moe_children(backend)

    def prepare_http(self, routes: Iterable[tuple[str, str]]) -> None:
        """Create each HTTP route's series ((method, route) pairs): its latency, and its
        200 answers, at zero."""
        for method, route in routes:
            self.http_request_seconds.labels(method, route)
            self.http_requests.labels(method, route, "200").inc(0)

    def prepare_workers(self, workers: Iterable[tuple[int, str]]) -> None:
        """Create each worker's series ((index, device) pairs): not ready, no restarts."""
        for worker, device in workers:
            self.set_worker_ready(worker, device, False)
            self.worker_restarts.labels(str(worker), device).inc(0)

    # -----------------------------------------------------------------------------------

    def rejection_counters(self, candidates: Iterable[Candidate]) -> tuple[Any, ...]:
        """The counter children one decision's rejections increment, one per rejection."""
        return tuple(
            self._rejection_child(candidate.backend, candidate.reason_code or NO_REASON)
            for candidate in candidates
            if candidate.verdict == "rejected"
        )

    def decision_counters(self, decision: Decision, platform: str) -> tuple[Any, ...]:
        """The counter children a decision increments (a cached answer keeps them, so
        counting it again is one `inc()` each); `platform` as `platform_label` says."""
        child = self._selection_child(
            decision.backend or NO_BACKEND, decision.quantization, platform, decision.ruleset
        )
        return (child, *self.rejection_counters(decision.candidates))

    def failure_counters(self, failure: SelectionError) -> tuple[Any, ...]:
        """The counter children a failed decision increments: its stage and exception
        type, and its rejections."""
        child = self._failure_child(failure.error.stage, failure.error.type)
        return (child, *self.rejection_counters(failure.candidates))

    def count_rejections(self, candidates: Iterable[Candidate]) -> None:
        for child in self.rejection_counters(candidates):
            child.inc()

    def count_failure(self, failure: SelectionError) -> None:
        for child in self.failure_counters(failure):
            child.inc()

    def count_decision(self, decision: Decision, platform: str) -> None:
        for child in self.decision_counters(decision, platform):
            child.inc()

    def count_observation(self, backend: str | None, integration: str | None, ruleset: str) -> None:
        """One reported decision (labels bounded: an unknown value counts as `other`)."""
        backend_label = NO_BACKEND if backend is None else backend
        if backend_label != NO_BACKEND and backend_label not in self._known_backends:
            backend_label = OTHER
        integration_label = integration if integration in INTEGRATIONS else OTHER
        self.observed_decisions.labels(
            backend_label, integration_label, self._ruleset_label(ruleset)
        ).inc()

    def count_mismatch(self, ruleset: str, field: str) -> None:
        """One reported decision the server answers differently, at its first field."""
        self.prediction_mismatches.labels(
            self._ruleset_label(ruleset), field if field in COMPARED_FIELDS else OTHER
        ).inc()

    def count_unmodelled(self, ruleset: str, agreement: str) -> None:
        """One reported decision of a release no ruleset models, compared with `ruleset`
        ("" when none), and how the two agree (`AGREEMENTS`)."""
        self.unmodelled_releases.labels(
            self._ruleset_label(ruleset), agreement if agreement in AGREEMENTS else OTHER
        ).inc()

    @staticmethod
    def _ruleset_label(ruleset: str) -> str:
        return ruleset if ruleset in RULESETS else NO_RULESET

    def run_moe_children(self, backend: str) -> tuple[Any, Any]:
        """(duration histogram child, token counter child) of a backend's RunMoE calls,
        resolved once per backend: `labels()` costs a lock and a dict lookup per call."""
        children = self._run_moe_children.get(backend)
        if children is None:
            children = self._run_moe_children[backend] = (
                self.run_moe_seconds.labels(backend),
                self.run_moe_tokens.labels(backend),
            )
        return children

    def set_worker_ready(self, worker: int, device: str, ready: bool) -> None:
        self.worker_ready.labels(str(worker), device).set(1 if ready else 0)

    def count_worker_restart(self, worker: int, device: str) -> None:
        self.worker_restarts.labels(str(worker), device).inc()

    def exposition(self) -> bytes:
        """The text exposition format of every collector (what /metrics serves)."""
        return generate_latest(self.registry)
