"""SelectBackend's use case: a deployment and a platform in, vLLM's decision out.

A decision is a pure function of the deployment, the ruleset and the platform; the platform
is the request's (a preset, a profile, a worker's) or else worker 0's. The workers are seen
through `PlatformSource`, which the pool and a replica's view of it both provide: its
`generation` moves on whenever any worker changed, so whoever keeps answers (the API's
answer cache) knows when they are stale. Every decision is counted in the metrics (under its
platform's label: a preset's name, `explicit`, or `worker`), and a failed one counts its
stage, exception type and rejections; a caller that serves a kept answer again recounts it
with the counters returned beside the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from service.metrics import WORKER_PLATFORM, Metrics, platform_label
from service.oracle import (
    DEFAULT_RULESET,
    Decision,
    DeploymentSpec,
    PlatformProfile,
    SelectionError,
    parse_deployment,
    resolve_ruleset,
    select,
)
from service.pool.errors import WorkerUnavailableError


class PlatformSource(Protocol):
    """What selection needs from the workers (WorkerPool, or a replica's view of it)."""

    @property
    def generation(self) -> int:
        """Moves on whenever any worker's state or profile may have changed."""
        ...

    def profile(self, index: int) -> PlatformProfile:
        """A ready worker's profile (WorkerNotFoundError, WorkerUnavailableError)."""
        ...

    def default_profile(self) -> PlatformProfile | None:
        """Worker 0's profile while it is ready."""
        ...


@dataclass(frozen=True, slots=True)
class PlatformChoice:
    """The platform a request names, exactly one of: a preset's name, a profile (its JSON
    form, as `PlatformProfile.from_json` reads it), or a worker's index."""

    preset: str | None = None
    profile: dict[str, Any] | None = None
    worker_index: int | None = None

    def resolve(self, profile_of: Callable[[int], PlatformProfile]) -> str | dict[str, Any]:
        """The deployment spec's "platform" value for this choice."""
        if self.preset is not None:
            return self.preset
        if self.profile is not None:
            return self.profile
        assert self.worker_index is not None
        return profile_of(self.worker_index).to_json()


@dataclass(frozen=True, slots=True)
class MeasureOptions:
    """What policy MEASURED adds to a request: the token counts to answer for (none: the
    defaults), the worker that measures (None: the platform's worker, else worker 0) and
    whether to measure again what is cached."""

    token_counts: tuple[int, ...] = ()
    worker_index: int | None = None
    refresh: bool = False


@dataclass(slots=True)
class SelectQuery:
    """One SelectBackend request: the deployment spec (the JSON object the oracle parses),
    the platform it names (None: worker 0's), the ruleset ("" for the default), for
    policy MEASURED its options, and whether to answer what would change the decision."""

    spec: dict[str, Any]
    platform: PlatformChoice | None = None
    ruleset: str = ""
    measure: MeasureOptions | None = None
    what_would_change: bool = False


@dataclass(frozen=True, slots=True)
class Timing:
    """One backend's device time for one token count (None: it failed, `error` says why)."""

    backend: str
    error: str
    seconds: float | None


@dataclass(frozen=True, slots=True)
class Bucket:
    """The timings of one token count, the fastest backend and vLLM's choice beside it
    (`static_seconds` and `speedup` only where the static choice ran)."""

    tokens: int
    static_backend: str
    timings: tuple[Timing, ...]
    static_seconds: float | None = None
    fastest: tuple[float, str] | None = None
    speedup: float | None = None


@dataclass(frozen=True, slots=True)
class MeasuredSelection:
    """The measured part of a MEASURED answer (service/dataplane/measured.py)."""

    worker_index: int
    device_name: str
    versions: dict[str, str]
    buckets: tuple[Bucket, ...]
    #: When the oldest of the timings answered was taken (seconds since the epoch).
    measured_time: float | None
    from_cache: bool = False
    measure_seconds: float = 0.0


@dataclass(slots=True)
class SelectAnswer:
    """A decision (`decision`, on `platform`, with worker 0's platform beside it when it is
    known), or, in a measured answer only, the static failure vLLM would hit (`failure`).
    `measured` is the measured part of a MEASURED answer."""

    ruleset: str
    decision: Decision | None = None
    platform: PlatformProfile | None = None
    server_platform: PlatformProfile | None = None
    failure: SelectionError | None = None
    measured: MeasuredSelection | None = None


class Selector:
    """Static selection for one server process."""

    def __init__(self, platforms: PlatformSource, metrics: Metrics) -> None:
        self.platforms = platforms
        self._metrics = metrics

    @property
    def generation(self) -> int:
        """Moves on whenever a worker changes (answers kept under an older one are stale)."""
        return self.platforms.generation

    def decide(self, query: SelectQuery) -> tuple[SelectAnswer, tuple[Any, ...]]:
        """The answer, with the metric children it incremented (a caller that keeps the
        answer increments them again when it serves it again); domain errors propagate,
        a failed decision's rejections counted."""
        spec, deployment, default = self.deployment(query.spec, query.platform)
        named_worker = query.platform is not None and query.platform.worker_index is not None
        platform = WORKER_PLATFORM if named_worker else platform_label(spec.get("platform"))
        # the request's field wins over the spec's own; with neither, the newest release
        ruleset = resolve_ruleset(query.ruleset or deployment.ruleset or DEFAULT_RULESET)
        try:
            decision = select(
                deployment, ruleset=ruleset, what_would_change=query.what_would_change
            )
        except SelectionError as exc:
            self._metrics.count_failure(exc)
            raise
        counters = self._metrics.decision_counters(decision, platform)
        for counter in counters:
            counter.inc()
        return SelectAnswer(ruleset, decision, deployment.platform, default), counters

    def deployment(
        self, spec: dict[str, Any], choice: PlatformChoice | None
    ) -> tuple[dict[str, Any], DeploymentSpec, PlatformProfile | None]:
        """The spec with the platform a request names laid over it (a copy: the request's
        own stays as given), its parsed deployment (without a platform: worker 0's) and
        worker 0's profile (None while it is not ready)."""
        if choice is not None:
            spec = {**spec, "platform": choice.resolve(self.platforms.profile)}
        default = self.platforms.default_profile()
        if spec.get("platform") is None and default is None:
            raise WorkerUnavailableError(
                "no worker is ready to supply the default platform; "
                "name a preset or a platform for a what-if answer"
            )
        return spec, parse_deployment(spec, default_platform=default), default

    def count_failure(self, failure: SelectionError) -> None:
        """Count a failed decision again, its rejections with it (a kept answer served
        again)."""
        self._metrics.count_failure(failure)

    def failure_counters(self, failure: SelectionError) -> tuple[Any, ...]:
        """The metric children a failed decision incremented (for a caller that keeps the
        failure's answer and counts it again when it serves it again)."""
        return self._metrics.failure_counters(failure)
