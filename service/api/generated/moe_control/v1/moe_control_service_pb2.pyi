import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from service.api.generated.moe_control.v1 import measured_pb2 as _measured_pb2
from service.api.generated.moe_control.v1 import observed_pb2 as _observed_pb2
from service.api.generated.moe_control.v1 import platform_pb2 as _platform_pb2
from service.api.generated.moe_control.v1 import selection_pb2 as _selection_pb2
from service.api.generated.moe_control.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MatrixOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MATRIX_OUTCOME_UNSPECIFIED: _ClassVar[MatrixOutcome]
    MATRIX_OUTCOME_CHOSEN: _ClassVar[MatrixOutcome]
    MATRIX_OUTCOME_UNQUANTIZED: _ClassVar[MatrixOutcome]
    MATRIX_OUTCOME_FAILS: _ClassVar[MatrixOutcome]
    MATRIX_OUTCOME_INVALID: _ClassVar[MatrixOutcome]
    MATRIX_OUTCOME_ERROR: _ClassVar[MatrixOutcome]
MATRIX_OUTCOME_UNSPECIFIED: MatrixOutcome
MATRIX_OUTCOME_CHOSEN: MatrixOutcome
MATRIX_OUTCOME_UNQUANTIZED: MatrixOutcome
MATRIX_OUTCOME_FAILS: MatrixOutcome
MATRIX_OUTCOME_INVALID: MatrixOutcome
MATRIX_OUTCOME_ERROR: MatrixOutcome

class SelectBackendRequest(_message.Message):
    __slots__ = ("spec", "spec_json", "model_config", "platform", "ruleset", "policy", "token_counts", "measure_worker_index", "refresh", "what_would_change")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    RULESET_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MEASURE_WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    WHAT_WOULD_CHANGE_FIELD_NUMBER: _ClassVar[int]
    spec: _selection_pb2.DeploymentSpec
    spec_json: str
    model_config: _selection_pb2.ModelConfig
    platform: _selection_pb2.PlatformSelector
    ruleset: str
    policy: _measured_pb2.SelectionPolicy
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    measure_worker_index: int
    refresh: bool
    what_would_change: bool
    def __init__(self, spec: _Optional[_Union[_selection_pb2.DeploymentSpec, _Mapping]] = ..., spec_json: _Optional[str] = ..., model_config: _Optional[_Union[_selection_pb2.ModelConfig, _Mapping]] = ..., platform: _Optional[_Union[_selection_pb2.PlatformSelector, _Mapping]] = ..., ruleset: _Optional[str] = ..., policy: _Optional[_Union[_measured_pb2.SelectionPolicy, str]] = ..., token_counts: _Optional[_Iterable[int]] = ..., measure_worker_index: _Optional[int] = ..., refresh: _Optional[bool] = ..., what_would_change: _Optional[bool] = ...) -> None: ...

class SelectBackendResponse(_message.Message):
    __slots__ = ("ruleset", "quantization", "moe_method", "backend", "experts_class", "weight_key", "may_have_zp", "may_have_bias", "allow_tile_padding", "candidates", "hazards", "platform", "server_platform", "measured", "explanation", "what_would_change")
    RULESET_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MOE_METHOD_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CLASS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_KEY_FIELD_NUMBER: _ClassVar[int]
    MAY_HAVE_ZP_FIELD_NUMBER: _ClassVar[int]
    MAY_HAVE_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_TILE_PADDING_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    HAZARDS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    SERVER_PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    WHAT_WOULD_CHANGE_FIELD_NUMBER: _ClassVar[int]
    ruleset: str
    quantization: str
    moe_method: str
    backend: str
    experts_class: str
    weight_key: _selection_pb2.WeightKey
    may_have_zp: bool
    may_have_bias: bool
    allow_tile_padding: bool
    candidates: _containers.RepeatedCompositeFieldContainer[_selection_pb2.BackendCandidate]
    hazards: _containers.RepeatedCompositeFieldContainer[_selection_pb2.Hazard]
    platform: _platform_pb2.PlatformProfile
    server_platform: _platform_pb2.PlatformProfile
    measured: _measured_pb2.MeasuredSelection
    explanation: str
    what_would_change: _selection_pb2.WhatWouldChange
    def __init__(self, ruleset: _Optional[str] = ..., quantization: _Optional[str] = ..., moe_method: _Optional[str] = ..., backend: _Optional[str] = ..., experts_class: _Optional[str] = ..., weight_key: _Optional[_Union[_selection_pb2.WeightKey, _Mapping]] = ..., may_have_zp: _Optional[bool] = ..., may_have_bias: _Optional[bool] = ..., allow_tile_padding: _Optional[bool] = ..., candidates: _Optional[_Iterable[_Union[_selection_pb2.BackendCandidate, _Mapping]]] = ..., hazards: _Optional[_Iterable[_Union[_selection_pb2.Hazard, _Mapping]]] = ..., platform: _Optional[_Union[_platform_pb2.PlatformProfile, _Mapping]] = ..., server_platform: _Optional[_Union[_platform_pb2.PlatformProfile, _Mapping]] = ..., measured: _Optional[_Union[_measured_pb2.MeasuredSelection, _Mapping]] = ..., explanation: _Optional[str] = ..., what_would_change: _Optional[_Union[_selection_pb2.WhatWouldChange, _Mapping]] = ...) -> None: ...

class SelectMatrixRequest(_message.Message):
    __slots__ = ("models", "gpus", "rulesets", "platform_json")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RULESETS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_JSON_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[MatrixModel]
    gpus: _containers.RepeatedScalarFieldContainer[str]
    rulesets: _containers.RepeatedScalarFieldContainer[str]
    platform_json: str
    def __init__(self, models: _Optional[_Iterable[_Union[MatrixModel, _Mapping]]] = ..., gpus: _Optional[_Iterable[str]] = ..., rulesets: _Optional[_Iterable[str]] = ..., platform_json: _Optional[str] = ...) -> None: ...

class MatrixModel(_message.Message):
    __slots__ = ("label", "origin", "spec_json")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    label: str
    origin: str
    spec_json: str
    def __init__(self, label: _Optional[str] = ..., origin: _Optional[str] = ..., spec_json: _Optional[str] = ...) -> None: ...

class MatrixCell(_message.Message):
    __slots__ = ("model", "ruleset", "gpu", "outcome", "backend", "hazards", "problem", "platform_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RULESET_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HAZARDS_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    ruleset: str
    gpu: str
    outcome: MatrixOutcome
    backend: str
    hazards: _containers.RepeatedCompositeFieldContainer[_selection_pb2.Hazard]
    problem: str
    platform_json: str
    def __init__(self, model: _Optional[str] = ..., ruleset: _Optional[str] = ..., gpu: _Optional[str] = ..., outcome: _Optional[_Union[MatrixOutcome, str]] = ..., backend: _Optional[str] = ..., hazards: _Optional[_Iterable[_Union[_selection_pb2.Hazard, _Mapping]]] = ..., problem: _Optional[str] = ..., platform_json: _Optional[str] = ...) -> None: ...

class SelectMatrixResponse(_message.Message):
    __slots__ = ("cells", "rulesets")
    CELLS_FIELD_NUMBER: _ClassVar[int]
    RULESETS_FIELD_NUMBER: _ClassVar[int]
    cells: _containers.RepeatedCompositeFieldContainer[MatrixCell]
    rulesets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cells: _Optional[_Iterable[_Union[MatrixCell, _Mapping]]] = ..., rulesets: _Optional[_Iterable[str]] = ...) -> None: ...

class DiffRulesetsRequest(_message.Message):
    __slots__ = ("spec", "spec_json", "model_config", "platform", "rulesets", "fail_on")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    RULESETS_FIELD_NUMBER: _ClassVar[int]
    FAIL_ON_FIELD_NUMBER: _ClassVar[int]
    spec: _selection_pb2.DeploymentSpec
    spec_json: str
    model_config: _selection_pb2.ModelConfig
    platform: _selection_pb2.PlatformSelector
    rulesets: _containers.RepeatedScalarFieldContainer[str]
    fail_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, spec: _Optional[_Union[_selection_pb2.DeploymentSpec, _Mapping]] = ..., spec_json: _Optional[str] = ..., model_config: _Optional[_Union[_selection_pb2.ModelConfig, _Mapping]] = ..., platform: _Optional[_Union[_selection_pb2.PlatformSelector, _Mapping]] = ..., rulesets: _Optional[_Iterable[str]] = ..., fail_on: _Optional[_Iterable[str]] = ...) -> None: ...

class DiffRulesetsResponse(_message.Message):
    __slots__ = ("answers", "differences", "changes", "fail_on", "changed")
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    FAIL_ON_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[RulesetAnswer]
    differences: _containers.RepeatedCompositeFieldContainer[RulesetDifference]
    changes: _containers.RepeatedCompositeFieldContainer[RulesetDifference]
    fail_on: _containers.RepeatedScalarFieldContainer[str]
    changed: bool
    def __init__(self, answers: _Optional[_Iterable[_Union[RulesetAnswer, _Mapping]]] = ..., differences: _Optional[_Iterable[_Union[RulesetDifference, _Mapping]]] = ..., changes: _Optional[_Iterable[_Union[RulesetDifference, _Mapping]]] = ..., fail_on: _Optional[_Iterable[str]] = ..., changed: _Optional[bool] = ...) -> None: ...

class RulesetAnswer(_message.Message):
    __slots__ = ("ruleset", "decision", "failure")
    RULESET_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ruleset: str
    decision: SelectBackendResponse
    failure: _selection_pb2.SelectionFailure
    def __init__(self, ruleset: _Optional[str] = ..., decision: _Optional[_Union[SelectBackendResponse, _Mapping]] = ..., failure: _Optional[_Union[_selection_pb2.SelectionFailure, _Mapping]] = ...) -> None: ...

class RulesetDifference(_message.Message):
    __slots__ = ("from_ruleset", "to_ruleset", "field", "before", "after", "cause", "fails_gate")
    FROM_RULESET_FIELD_NUMBER: _ClassVar[int]
    TO_RULESET_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    FAILS_GATE_FIELD_NUMBER: _ClassVar[int]
    from_ruleset: str
    to_ruleset: str
    field: str
    before: str
    after: str
    cause: str
    fails_gate: bool
    def __init__(self, from_ruleset: _Optional[str] = ..., to_ruleset: _Optional[str] = ..., field: _Optional[str] = ..., before: _Optional[str] = ..., after: _Optional[str] = ..., cause: _Optional[str] = ..., fails_gate: _Optional[bool] = ...) -> None: ...

class ConvertWeightsRequest(_message.Message):
    __slots__ = ("header", "tensor", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ConvertWeightsHeader
    tensor: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[ConvertWeightsHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ConvertWeightsHeader(_message.Message):
    __slots__ = ("spec", "spec_json", "model_config", "target_backend", "worker_index", "inline", "checkpoint", "keep_loaded", "max_chunk_bytes", "platform", "ruleset")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    TARGET_BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    KEEP_LOADED_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    RULESET_FIELD_NUMBER: _ClassVar[int]
    spec: _selection_pb2.DeploymentSpec
    spec_json: str
    model_config: _selection_pb2.ModelConfig
    target_backend: str
    worker_index: int
    inline: InlineConversion
    checkpoint: CheckpointConversion
    keep_loaded: bool
    max_chunk_bytes: int
    platform: _selection_pb2.PlatformSelector
    ruleset: str
    def __init__(self, spec: _Optional[_Union[_selection_pb2.DeploymentSpec, _Mapping]] = ..., spec_json: _Optional[str] = ..., model_config: _Optional[_Union[_selection_pb2.ModelConfig, _Mapping]] = ..., target_backend: _Optional[str] = ..., worker_index: _Optional[int] = ..., inline: _Optional[_Union[InlineConversion, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointConversion, _Mapping]] = ..., keep_loaded: _Optional[bool] = ..., max_chunk_bytes: _Optional[int] = ..., platform: _Optional[_Union[_selection_pb2.PlatformSelector, _Mapping]] = ..., ruleset: _Optional[str] = ...) -> None: ...

class InlineConversion(_message.Message):
    __slots__ = ("return_tensors",)
    RETURN_TENSORS_FIELD_NUMBER: _ClassVar[int]
    return_tensors: bool
    def __init__(self, return_tensors: _Optional[bool] = ...) -> None: ...

class CheckpointConversion(_message.Message):
    __slots__ = ("input_dir", "output_dir", "layers")
    INPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    input_dir: str
    output_dir: str
    layers: LayerRange
    def __init__(self, input_dir: _Optional[str] = ..., output_dir: _Optional[str] = ..., layers: _Optional[_Union[LayerRange, _Mapping]] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ConvertWeightsResponse(_message.Message):
    __slots__ = ("tensor", "chunk", "progress", "summary")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorHeader
    chunk: _tensor_pb2.TensorChunk
    progress: ConvertProgress
    summary: ConvertSummary
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., progress: _Optional[_Union[ConvertProgress, _Mapping]] = ..., summary: _Optional[_Union[ConvertSummary, _Mapping]] = ...) -> None: ...

class ConvertProgress(_message.Message):
    __slots__ = ("layers_done", "layers_total", "bytes_done", "bytes_total", "current", "stage")
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    layers_done: int
    layers_total: int
    bytes_done: int
    bytes_total: int
    current: str
    stage: str
    def __init__(self, layers_done: _Optional[int] = ..., layers_total: _Optional[int] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., current: _Optional[str] = ..., stage: _Optional[str] = ...) -> None: ...

class KernelFormat(_message.Message):
    __slots__ = ("backend", "experts_class", "bits", "group_size", "has_zero_points", "attributes")
    class AttributesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CLASS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_ZERO_POINTS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    experts_class: str
    bits: int
    group_size: int
    has_zero_points: bool
    attributes: _containers.ScalarMap[str, str]
    def __init__(self, backend: _Optional[str] = ..., experts_class: _Optional[str] = ..., bits: _Optional[int] = ..., group_size: _Optional[int] = ..., has_zero_points: _Optional[bool] = ..., attributes: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ConvertSummary(_message.Message):
    __slots__ = ("target_format", "tensors", "bytes_in", "bytes_out", "elapsed", "layer_id", "manifest_path", "device_time", "layers_converted", "layers_skipped", "backend_chosen_by")
    TARGET_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_FIELD_NUMBER: _ClassVar[int]
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TIME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_CONVERTED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BACKEND_CHOSEN_BY_FIELD_NUMBER: _ClassVar[int]
    target_format: KernelFormat
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorHeader]
    bytes_in: int
    bytes_out: int
    elapsed: _duration_pb2.Duration
    layer_id: str
    manifest_path: str
    device_time: _duration_pb2.Duration
    layers_converted: int
    layers_skipped: int
    backend_chosen_by: str
    def __init__(self, target_format: _Optional[_Union[KernelFormat, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorHeader, _Mapping]]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., elapsed: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., layer_id: _Optional[str] = ..., manifest_path: _Optional[str] = ..., device_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., layers_converted: _Optional[int] = ..., layers_skipped: _Optional[int] = ..., backend_chosen_by: _Optional[str] = ...) -> None: ...

class RunMoERequest(_message.Message):
    __slots__ = ("layer_id", "inline_layer", "hidden_states", "router_logits", "topk", "backend", "worker_index", "warmup_iterations", "timed_iterations", "compare_with_reference", "validate_inputs", "ruleset")
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    INLINE_LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    WARMUP_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    TIMED_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    COMPARE_WITH_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    RULESET_FIELD_NUMBER: _ClassVar[int]
    layer_id: str
    inline_layer: InlineLayer
    hidden_states: _tensor_pb2.Tensor
    router_logits: _tensor_pb2.Tensor
    topk: TopKRouting
    backend: str
    worker_index: int
    warmup_iterations: int
    timed_iterations: int
    compare_with_reference: bool
    validate_inputs: bool
    ruleset: str
    def __init__(self, layer_id: _Optional[str] = ..., inline_layer: _Optional[_Union[InlineLayer, _Mapping]] = ..., hidden_states: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., router_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., topk: _Optional[_Union[TopKRouting, _Mapping]] = ..., backend: _Optional[str] = ..., worker_index: _Optional[int] = ..., warmup_iterations: _Optional[int] = ..., timed_iterations: _Optional[int] = ..., compare_with_reference: _Optional[bool] = ..., validate_inputs: _Optional[bool] = ..., ruleset: _Optional[str] = ...) -> None: ...

class TopKRouting(_message.Message):
    __slots__ = ("topk_ids", "topk_weights")
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    topk_ids: _tensor_pb2.Tensor
    topk_weights: _tensor_pb2.Tensor
    def __init__(self, topk_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class InlineLayer(_message.Message):
    __slots__ = ("spec", "tensors")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    spec: _selection_pb2.DeploymentSpec
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    def __init__(self, spec: _Optional[_Union[_selection_pb2.DeploymentSpec, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class RunMoEResponse(_message.Message):
    __slots__ = ("output", "backend", "experts_class", "device_time", "worker_index", "max_abs_error")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CLASS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TIME_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_ERROR_FIELD_NUMBER: _ClassVar[int]
    output: _tensor_pb2.Tensor
    backend: str
    experts_class: str
    device_time: _duration_pb2.Duration
    worker_index: int
    max_abs_error: float
    def __init__(self, output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., backend: _Optional[str] = ..., experts_class: _Optional[str] = ..., device_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., worker_index: _Optional[int] = ..., max_abs_error: _Optional[float] = ...) -> None: ...

class GetPlatformRequest(_message.Message):
    __slots__ = ("worker_index",)
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    def __init__(self, worker_index: _Optional[int] = ...) -> None: ...

class GetPlatformResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _platform_pb2.WorkerInfo
    def __init__(self, worker: _Optional[_Union[_platform_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class ListPlatformPresetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPlatformPresetsResponse(_message.Message):
    __slots__ = ("presets",)
    PRESETS_FIELD_NUMBER: _ClassVar[int]
    presets: _containers.RepeatedCompositeFieldContainer[_platform_pb2.PlatformPreset]
    def __init__(self, presets: _Optional[_Iterable[_Union[_platform_pb2.PlatformPreset, _Mapping]]] = ...) -> None: ...

class ListRulesetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRulesetsResponse(_message.Message):
    __slots__ = ("rulesets",)
    RULESETS_FIELD_NUMBER: _ClassVar[int]
    rulesets: _containers.RepeatedCompositeFieldContainer[_selection_pb2.RulesetInfo]
    def __init__(self, rulesets: _Optional[_Iterable[_Union[_selection_pb2.RulesetInfo, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "ready", "ready_workers")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    READY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_platform_pb2.WorkerInfo]
    ready: bool
    ready_workers: int
    def __init__(self, workers: _Optional[_Iterable[_Union[_platform_pb2.WorkerInfo, _Mapping]]] = ..., ready: _Optional[bool] = ..., ready_workers: _Optional[int] = ...) -> None: ...

class LayerInfo(_message.Message):
    __slots__ = ("layer_id", "worker_index", "format", "num_experts", "hidden_size", "intermediate_size", "byte_size", "load_time", "last_used_time", "device")
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_TIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    layer_id: str
    worker_index: int
    format: KernelFormat
    num_experts: int
    hidden_size: int
    intermediate_size: int
    byte_size: int
    load_time: _timestamp_pb2.Timestamp
    last_used_time: _timestamp_pb2.Timestamp
    device: str
    def __init__(self, layer_id: _Optional[str] = ..., worker_index: _Optional[int] = ..., format: _Optional[_Union[KernelFormat, _Mapping]] = ..., num_experts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., byte_size: _Optional[int] = ..., load_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_used_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., device: _Optional[str] = ...) -> None: ...

class ListLayersRequest(_message.Message):
    __slots__ = ("worker_index",)
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    def __init__(self, worker_index: _Optional[int] = ...) -> None: ...

class ListLayersResponse(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerInfo]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerInfo, _Mapping]]] = ...) -> None: ...

class UnloadLayerRequest(_message.Message):
    __slots__ = ("layer_id",)
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    layer_id: str
    def __init__(self, layer_id: _Optional[str] = ...) -> None: ...

class UnloadLayerResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...
