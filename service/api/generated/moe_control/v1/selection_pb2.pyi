from google.protobuf import struct_pb2 as _struct_pb2
from service.api.generated.moe_control.v1 import platform_pb2 as _platform_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuantMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUANT_METHOD_UNSPECIFIED: _ClassVar[QuantMethod]
    QUANT_METHOD_GPTQ: _ClassVar[QuantMethod]
    QUANT_METHOD_AWQ: _ClassVar[QuantMethod]
    QUANT_METHOD_COMPRESSED_TENSORS: _ClassVar[QuantMethod]

class ActOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACT_ORDER_UNSPECIFIED: _ClassVar[ActOrder]
    ACT_ORDER_NONE: _ClassVar[ActOrder]
    ACT_ORDER_GROUP: _ClassVar[ActOrder]
    ACT_ORDER_WEIGHT: _ClassVar[ActOrder]
    ACT_ORDER_DYNAMIC: _ClassVar[ActOrder]

class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_UNSPECIFIED: _ClassVar[Verdict]
    VERDICT_SELECTED: _ClassVar[Verdict]
    VERDICT_REJECTED: _ClassVar[Verdict]
    VERDICT_NOT_REACHED: _ClassVar[Verdict]
QUANT_METHOD_UNSPECIFIED: QuantMethod
QUANT_METHOD_GPTQ: QuantMethod
QUANT_METHOD_AWQ: QuantMethod
QUANT_METHOD_COMPRESSED_TENSORS: QuantMethod
ACT_ORDER_UNSPECIFIED: ActOrder
ACT_ORDER_NONE: ActOrder
ACT_ORDER_GROUP: ActOrder
ACT_ORDER_WEIGHT: ActOrder
ACT_ORDER_DYNAMIC: ActOrder
VERDICT_UNSPECIFIED: Verdict
VERDICT_SELECTED: Verdict
VERDICT_REJECTED: Verdict
VERDICT_NOT_REACHED: Verdict

class QuantizationConfig(_message.Message):
    __slots__ = ("hf_config", "hf_config_json", "explicit")
    HF_CONFIG_FIELD_NUMBER: _ClassVar[int]
    HF_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_FIELD_NUMBER: _ClassVar[int]
    hf_config: _struct_pb2.Struct
    hf_config_json: str
    explicit: ExplicitQuantization
    def __init__(self, hf_config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., hf_config_json: _Optional[str] = ..., explicit: _Optional[_Union[ExplicitQuantization, _Mapping]] = ...) -> None: ...

class ExplicitQuantization(_message.Message):
    __slots__ = ("method", "bits", "group_size", "symmetric", "desc_act", "act_order", "checkpoint_format", "version")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYMMETRIC_FIELD_NUMBER: _ClassVar[int]
    DESC_ACT_FIELD_NUMBER: _ClassVar[int]
    ACT_ORDER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    method: QuantMethod
    bits: int
    group_size: int
    symmetric: bool
    desc_act: bool
    act_order: ActOrder
    checkpoint_format: str
    version: str
    def __init__(self, method: _Optional[_Union[QuantMethod, str]] = ..., bits: _Optional[int] = ..., group_size: _Optional[int] = ..., symmetric: _Optional[bool] = ..., desc_act: _Optional[bool] = ..., act_order: _Optional[_Union[ActOrder, str]] = ..., checkpoint_format: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class RoutingConfig(_message.Message):
    __slots__ = ("scoring_func", "renormalize", "use_grouped_topk", "num_expert_group", "topk_group", "e_score_correction_bias", "routed_scaling_factor", "router_logits_dtype")
    SCORING_FUNC_FIELD_NUMBER: _ClassVar[int]
    RENORMALIZE_FIELD_NUMBER: _ClassVar[int]
    USE_GROUPED_TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERT_GROUP_FIELD_NUMBER: _ClassVar[int]
    TOPK_GROUP_FIELD_NUMBER: _ClassVar[int]
    E_SCORE_CORRECTION_BIAS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_SCALING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ROUTER_LOGITS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    scoring_func: str
    renormalize: bool
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    e_score_correction_bias: bool
    routed_scaling_factor: float
    router_logits_dtype: str
    def __init__(self, scoring_func: _Optional[str] = ..., renormalize: _Optional[bool] = ..., use_grouped_topk: _Optional[bool] = ..., num_expert_group: _Optional[int] = ..., topk_group: _Optional[int] = ..., e_score_correction_bias: _Optional[bool] = ..., routed_scaling_factor: _Optional[float] = ..., router_logits_dtype: _Optional[str] = ...) -> None: ...

class MoeLayer(_message.Message):
    __slots__ = ("num_experts", "top_k", "hidden_size", "intermediate_size", "activation", "has_bias", "dtype", "routing", "name")
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    HAS_BIAS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    has_bias: bool
    dtype: str
    routing: RoutingConfig
    name: str
    def __init__(self, num_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., activation: _Optional[str] = ..., has_bias: _Optional[bool] = ..., dtype: _Optional[str] = ..., routing: _Optional[_Union[RoutingConfig, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class ParallelConfig(_message.Message):
    __slots__ = ("tensor_parallel_size", "enable_expert_parallel", "data_parallel_size", "all2all_backend", "enable_eplb")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALL2ALL_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENABLE_EPLB_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    enable_expert_parallel: bool
    data_parallel_size: int
    all2all_backend: str
    enable_eplb: bool
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., enable_expert_parallel: _Optional[bool] = ..., data_parallel_size: _Optional[int] = ..., all2all_backend: _Optional[str] = ..., enable_eplb: _Optional[bool] = ...) -> None: ...

class DeploymentSpec(_message.Message):
    __slots__ = ("quantization_config", "quantization", "layer", "parallel", "moe_backend", "lora")
    QUANTIZATION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    quantization_config: QuantizationConfig
    quantization: str
    layer: MoeLayer
    parallel: ParallelConfig
    moe_backend: str
    lora: bool
    def __init__(self, quantization_config: _Optional[_Union[QuantizationConfig, _Mapping]] = ..., quantization: _Optional[str] = ..., layer: _Optional[_Union[MoeLayer, _Mapping]] = ..., parallel: _Optional[_Union[ParallelConfig, _Mapping]] = ..., moe_backend: _Optional[str] = ..., lora: _Optional[bool] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("config_json", "config", "quantization", "parallel", "moe_backend", "lora")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    config: _struct_pb2.Struct
    quantization: str
    parallel: ParallelConfig
    moe_backend: str
    lora: bool
    def __init__(self, config_json: _Optional[str] = ..., config: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., quantization: _Optional[str] = ..., parallel: _Optional[_Union[ParallelConfig, _Mapping]] = ..., moe_backend: _Optional[str] = ..., lora: _Optional[bool] = ...) -> None: ...

class PlatformSelector(_message.Message):
    __slots__ = ("preset", "profile", "worker_index")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    preset: str
    profile: _platform_pb2.PlatformProfile
    worker_index: int
    def __init__(self, preset: _Optional[str] = ..., profile: _Optional[_Union[_platform_pb2.PlatformProfile, _Mapping]] = ..., worker_index: _Optional[int] = ...) -> None: ...

class BackendCandidate(_message.Message):
    __slots__ = ("backend", "verdict", "reason_code", "reason", "explanation")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    backend: str
    verdict: Verdict
    reason_code: str
    reason: str
    explanation: str
    def __init__(self, backend: _Optional[str] = ..., verdict: _Optional[_Union[Verdict, str]] = ..., reason_code: _Optional[str] = ..., reason: _Optional[str] = ..., explanation: _Optional[str] = ...) -> None: ...

class DecisionChange(_message.Message):
    __slots__ = ("kind", "field", "value", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    field: str
    value: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., field: _Optional[str] = ..., value: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ChangeHint(_message.Message):
    __slots__ = ("backend", "outcome", "changes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    outcome: str
    changes: _containers.RepeatedCompositeFieldContainer[DecisionChange]
    def __init__(self, backend: _Optional[str] = ..., outcome: _Optional[str] = ..., changes: _Optional[_Iterable[_Union[DecisionChange, _Mapping]]] = ...) -> None: ...

class WhatWouldChange(_message.Message):
    __slots__ = ("hints",)
    HINTS_FIELD_NUMBER: _ClassVar[int]
    hints: _containers.RepeatedCompositeFieldContainer[ChangeHint]
    def __init__(self, hints: _Optional[_Iterable[_Union[ChangeHint, _Mapping]]] = ...) -> None: ...

class Hazard(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class WeightKey(_message.Message):
    __slots__ = ("dtype", "scale_dtype", "group_shape", "symmetric")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SYMMETRIC_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    scale_dtype: str
    group_shape: _containers.RepeatedScalarFieldContainer[int]
    symmetric: bool
    def __init__(self, dtype: _Optional[str] = ..., scale_dtype: _Optional[str] = ..., group_shape: _Optional[_Iterable[int]] = ..., symmetric: _Optional[bool] = ...) -> None: ...

class SelectionFailure(_message.Message):
    __slots__ = ("stage", "type", "message", "quantization", "moe_method", "candidates", "ruleset", "platform", "what_would_change")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MOE_METHOD_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    RULESET_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    WHAT_WOULD_CHANGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    type: str
    message: str
    quantization: str
    moe_method: str
    candidates: _containers.RepeatedCompositeFieldContainer[BackendCandidate]
    ruleset: str
    platform: _platform_pb2.PlatformProfile
    what_would_change: WhatWouldChange
    def __init__(self, stage: _Optional[str] = ..., type: _Optional[str] = ..., message: _Optional[str] = ..., quantization: _Optional[str] = ..., moe_method: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[BackendCandidate, _Mapping]]] = ..., ruleset: _Optional[str] = ..., platform: _Optional[_Union[_platform_pb2.PlatformProfile, _Mapping]] = ..., what_would_change: _Optional[_Union[WhatWouldChange, _Mapping]] = ...) -> None: ...

class RulesetInfo(_message.Message):
    __slots__ = ("name", "first_version", "below_version", "torch_version", "humming_kernels_version", "is_default", "backends", "moe_backends")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FIRST_VERSION_FIELD_NUMBER: _ClassVar[int]
    BELOW_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    HUMMING_KERNELS_VERSION_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    MOE_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    first_version: str
    below_version: str
    torch_version: str
    humming_kernels_version: str
    is_default: bool
    backends: _containers.RepeatedScalarFieldContainer[str]
    moe_backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., first_version: _Optional[str] = ..., below_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., humming_kernels_version: _Optional[str] = ..., is_default: _Optional[bool] = ..., backends: _Optional[_Iterable[str]] = ..., moe_backends: _Optional[_Iterable[str]] = ...) -> None: ...
