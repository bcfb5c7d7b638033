"""The worker's methods as types: one frozen request and its answer per method.

The server's pool and data plane build a request, `WorkerHandle.call` sends it and returns
its answer type (`Request[A]` -> `A`); the worker decodes each line into the request type
its method names and dispatches on that type. So a parameter both sides must agree on is a
field here, written once, and mypy follows a call from the servicer to the job that serves
it. On the pipe each is the JSON object `codec` makes of it, field by field under the
field's name (`protocol.request(id, METHOD, to_json(request))`); tensors never travel
here, only the names of the segment files that hold them (`segments`).

Background methods (`BACKGROUND`) run as jobs of the worker: cancellable, and a job may
send progress events before its answer (a checkpoint conversion's per-layer progress).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from service.formats.io.streaming import TensorSpec
from service.formats.routes.spec import SourceSpec

A = TypeVar("A")
#: A checkpoint conversion's answer lists at most this many tensors (its manifest has them
#: all): the answer is one pipe line.
MAX_LISTED_TENSORS = 20_000


class Request(Generic[A]):
    """A worker method's parameters; `A` is the type of its answer."""

    __slots__ = ()
    #: The method's name on the pipe.
    METHOD: ClassVar[str]
    #: Whether the worker runs it as a background job (cancellable; may send events).
    BACKGROUND: ClassVar[bool] = False

    def answer_type(self) -> type[A]:
        raise NotImplementedError


# -- what several methods share


@dataclass(frozen=True, slots=True)
class SegmentTensor:
    """A tensor in the server's segment directory: its declaration and its file's name
    ("" when its bytes were not asked for: a conversion's `return_tensors` off)."""

    spec: TensorSpec
    segment: str = ""


@dataclass(frozen=True, slots=True)
class LayerShape:
    """A MoE layer's shape, as the conversion checks the tensors against it."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    gated: bool = True


# -- quick methods (answered inline by the worker's request loop)


@dataclass(frozen=True, slots=True)
class Pong:
    pid: int


@dataclass(frozen=True, slots=True)
class Ping(Request[Pong]):
    """Is the worker alive and answering (the supervisor's health check)."""

    METHOD = "ping"

    def answer_type(self) -> type[Pong]:
        return Pong


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    """The hello's profile (device, platform) and each backend's availability here."""

    info: dict[str, Any]
    kernels: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Profile(Request[WorkerProfile]):
    """The worker's profile with its kernels' status (imports torch on first call)."""

    METHOD = "profile"

    def answer_type(self) -> type[WorkerProfile]:
        return WorkerProfile


@dataclass(frozen=True, slots=True)
class LayersListed:
    #: Each kept layer's LayerInfo JSON, least recently used first.
    layers: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class ListLayers(Request[LayersListed]):
    METHOD = "list_layers"

    def answer_type(self) -> type[LayersListed]:
        return LayersListed


@dataclass(frozen=True, slots=True)
class LayerUnloaded:
    found: bool
    freed_bytes: int = 0


@dataclass(frozen=True, slots=True)
class UnloadLayer(Request[LayerUnloaded]):
    METHOD = "unload_layer"
    layer_id: str

    def answer_type(self) -> type[LayerUnloaded]:
        return LayerUnloaded


@dataclass(frozen=True, slots=True)
class Cancelled:
    cancelled: bool


@dataclass(frozen=True, slots=True)
class Cancel(Request[Cancelled]):
    """Stop background call `call_id` (its answer then says it was cancelled)."""

    METHOD = "cancel"
    call_id: int

    def answer_type(self) -> type[Cancelled]:
        return Cancelled


@dataclass(frozen=True, slots=True)
class TargetChecked:
    supported: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CheckTarget(Request[TargetChecked]):
    """Whether the worker can write `backend`'s layout (asked before any data moves)."""

    METHOD = "check_target"
    backend: str

    def answer_type(self) -> type[TargetChecked]:
        return TargetChecked


# -- background methods (jobs)


@dataclass(frozen=True, slots=True)
class LayerConverted:
    #: The converted tensors; their bytes are in segments unless `return_tensors` was off.
    tensors: tuple[SegmentTensor, ...]
    descriptor: dict[str, Any]
    device_seconds: float
    #: The kept layer's id ("" unless `keep_loaded`).
    layer_id: str = ""


@dataclass(frozen=True, slots=True)
class ConvertLayer(Request[LayerConverted]):
    """Convert one inline layer whose tensors are in segments, under `ruleset`'s rules."""

    METHOD = "convert_layer"
    BACKGROUND = True
    segments_dir: str
    inputs: tuple[SegmentTensor, ...]
    source: SourceSpec
    backend: str
    ruleset: str
    shape: LayerShape
    #: Names the converted tensors' segments (`<out_prefix><n>`).
    out_prefix: str
    experts_class: str = ""
    #: vLLM's --quantization, when forced (None: none).
    quantization: str | None = None
    keep_loaded: bool = False
    return_tensors: bool = True
    #: The deployment spec JSON a kept layer runs by (routing, activation).
    deployment: dict[str, Any] = field(default_factory=dict)
    layer_budget_bytes: int | None = None

    def answer_type(self) -> type[LayerConverted]:
        return LayerConverted


@dataclass(frozen=True, slots=True)
class CheckpointConverted:
    manifest_path: str
    output_dir: str
    layers_total: int
    layers_converted: int
    layers_skipped: int
    bytes_in: int
    bytes_out: int
    seconds: float
    device_seconds: float
    stage_seconds: dict[str, float]
    descriptor: dict[str, Any] | None
    #: The manifest's tensor entries (at most a bounded number; `tensors_total` counts all).
    tensors: tuple[dict[str, Any], ...]
    tensors_total: int


@dataclass(frozen=True, slots=True)
class ConvertCheckpoint(Request[CheckpointConverted]):
    """Convert a checkpoint on disk (or one range of its layers): `job` is a resolved
    `CheckpointJob`'s JSON, its paths confined by the server; the worker adds its device.
    Sends "progress" events as layers are converted."""

    METHOD = "convert_checkpoint"
    BACKGROUND = True
    job: dict[str, Any]

    def answer_type(self) -> type[CheckpointConverted]:
        return CheckpointConverted


@dataclass(frozen=True, slots=True)
class InlineWeights:
    """RunMoE's inline layer: its checkpoint tensors and how to convert them, under
    `ruleset`'s rules as ConvertLayer would."""

    tensors: tuple[SegmentTensor, ...]
    source: SourceSpec
    backend: str
    ruleset: str
    shape: LayerShape
    quantization: str | None = None
    deployment: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MoeRan:
    backend: str
    tokens: int
    #: Where the output is: the lent segment, or the worker's own (`out_spill`).
    output: SegmentTensor
    device_seconds: float
    max_abs_error: float | None = None
    #: Host seconds per stage of the call (bench/worker_call_overhead.py prints them).
    stages: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunMoE(Request[MoeRan]):
    """One fused MoE forward on a kept layer (`layer_id`) or on `inline` weights."""

    METHOD = "run_moe"
    BACKGROUND = True
    segments_dir: str
    #: hidden_states, then router_logits or topk.topk_ids and topk.topk_weights.
    inputs: tuple[SegmentTensor, ...]
    #: The lent output segment; the worker writes a new one, `out_spill`, when the output
    #: is more than `out_capacity` bytes (or no capacity is given).
    out_segment: str
    out_capacity: int | None = None
    out_spill: str = ""
    layer_id: str | None = None
    inline: InlineWeights | None = None
    backend: str = ""
    validate: bool = False
    warmup: int = 0
    timed: int = 1
    compare: bool = False

    def answer_type(self) -> type[MoeRan]:
        return MoeRan


@dataclass(frozen=True, slots=True)
class BackendTiming:
    backend: str
    #: Median seconds per forward by token count (the count as a string: a JSON key).
    seconds: dict[str, float] = field(default_factory=dict)
    #: Why it was not timed ("" when it was).
    error: str = ""


@dataclass(frozen=True, slots=True)
class BackendsMeasured:
    device_name: str
    versions: dict[str, str]
    results: tuple[BackendTiming, ...]


@dataclass(frozen=True, slots=True)
class MeasureBackends(Request[BackendsMeasured]):
    """Time `backends` on a synthetic layer of `shape` at each token count."""

    METHOD = "measure_backends"
    BACKGROUND = True
    #: num_experts, top_k, hidden_size, intermediate_size; optional dtype, activation.
    shape: dict[str, Any]
    source: SourceSpec
    backends: tuple[str, ...]
    token_counts: tuple[int, ...]
    #: Seconds each timing may take (None: the worker's default).
    budget_s: float | None = None
    seed: int = 0

    def answer_type(self) -> type[BackendsMeasured]:
        return BackendsMeasured


#: Every worker method by its name on the pipe: what the worker decodes a line into.
REQUESTS: dict[str, type[Request[Any]]] = {
    kind.METHOD: kind
    for kind in (
        Ping,
        Profile,
        ListLayers,
        UnloadLayer,
        Cancel,
        CheckTarget,
        ConvertLayer,
        ConvertCheckpoint,
        RunMoE,
        MeasureBackends,
    )
}
