"""The MoE layer as vLLM's kernels see it: vLLM's `FusedMoEConfig`, derived from a spec.

vLLM flattens TP across DP, switches to expert parallelism when asked and when there is more
than one rank, and derives the routing method from the router's scoring function. The
support checks of every experts class read these derived values, and some reason strings
print them, so they are reproduced here exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.oracle.errors import InvalidSpecError
from service.oracle.spec import DeploymentSpec, RoutingSpec

#: vLLM's `RoutingMethodType` (an IntEnum, so reason strings print the number).
ROUTING_METHODS = {
    "Default": 0,
    "Renormalize": 1,
    "DeepSeekV3": 2,
    "Llama4": 3,
    "RenormalizeNaive": 4,
    "TopK": 5,
    "SigmoidRenorm": 6,
    "MiniMax2": 7,
    "Sigmoid": 8,
    "Unspecified": 9,
    "DeepseekV4": 100,
    "Custom": 101,
    "Simulated": 102,
}


@dataclass(frozen=True, slots=True)
class MoEParallelConfig:
    """vLLM's `FusedMoEParallelConfig` for rank 0 of the deployment."""

    tp_size: int
    dp_size: int
    ep_size: int
    use_ep: bool
    all2all_backend: str
    enable_eplb: bool
    pcp_size: int = 1
    sp_size: int = 1

    @property
    def use_all2all_kernels(self) -> bool:
        return self.use_ep and (self.dp_size > 1 or self.pcp_size > 1 or self.sp_size > 1)

    def _all2all(self, *backends: str) -> bool:
        return self.use_all2all_kernels and self.all2all_backend in backends

    @property
    def use_fi_nvl_two_sided_kernels(self) -> bool:
        return self._all2all("flashinfer_all2allv", "flashinfer_nvlink_two_sided")

    @property
    def use_fi_nvl_one_sided_kernels(self) -> bool:
        return self._all2all("flashinfer_nvlink_one_sided")

    @property
    def use_ag_rs_all2all_kernels(self) -> bool:
        return self._all2all("allgather_reducescatter")

    @property
    def use_batched_activation_format(self) -> bool:
        """DeepEP low-latency and NIXL EP dispatch tokens in the batched format."""
        return self._all2all("deepep_low_latency", "nixl_ep")

    def render(self, extra: tuple[tuple[str, object], ...] = ()) -> str:
        """vLLM's dataclass repr, which its parallel-config reason prints; `extra` are the
        trailing fields a release adds that no deployment spec sets, with their values."""
        tail = "".join(f", {name}={value!r}" for name, value in extra)
        return (
            f"FusedMoEParallelConfig(tp_size={self.tp_size}, pcp_size={self.pcp_size}, "
            f"dp_size={self.dp_size}, ep_size={self.ep_size}, tp_rank=0, pcp_rank=0, "
            f"dp_rank=0, ep_rank=0, sp_size={self.sp_size}, use_ep={self.use_ep}, "
            f"all2all_backend={self.all2all_backend!r}, enable_eplb={self.enable_eplb}{tail})"
        )


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The fields of vLLM's `FusedMoEConfig` that backend selection reads."""

    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size_per_partition: int
    activation: str
    is_act_and_mul: bool
    in_dtype: str
    router_logits_dtype: str
    routing_method: str
    parallel: MoEParallelConfig
    is_lora_enabled: bool
    moe_backend: str


#: vLLM's `FusedMoEActivationFormat` values, as its reasons print them.
STANDARD_FORMAT = "standard"
BATCHED_FORMAT = "batched_experts"
#: 0.34's `PaddedStandard`: standard rows with inactive padding (DeepEP v2's dispatch).
PADDED_STANDARD_FORMAT = "padded_standard"


def format_accepts(experts_format: str, prepared_format: str) -> bool:
    """vLLM's `FusedMoEActivationFormat.is_superset`: whether experts declaring
    `experts_format` consume what the all2all prepare step hands them. A padding-aware
    (PaddedStandard) kernel also takes standard rows; otherwise only the same format.
    Releases before 0.34 compare for equality, the same relation while nothing declares
    or produces PaddedStandard, which is so up to 0.33."""
    return experts_format == prepared_format or (
        experts_format == PADDED_STANDARD_FORMAT and prepared_format == STANDARD_FORMAT
    )


def routing_method(routing: RoutingSpec) -> str:
    """vLLM's `get_routing_method_type`, fed the way its routers feed it."""
    if routing.use_grouped_topk:
        num_expert_group = routing.num_expert_group
        has_bias = routing.e_score_correction_bias
    else:
        num_expert_group = None
        has_bias = routing.e_score_correction_bias
    scoring, renormalize = routing.scoring_func, routing.renormalize
    if scoring == "sqrtsoftplus":
        return "DeepseekV4" if renormalize else "Unspecified"
    if has_bias:
        if scoring != "sigmoid" or not renormalize:
            return "Unspecified"
        return "DeepSeekV3" if (num_expert_group or 0) > 0 else "MiniMax2"
    if scoring == "sigmoid":
        return "SigmoidRenorm" if renormalize else "Sigmoid"
    if scoring == "softmax":
        return "RenormalizeNaive" if renormalize else "Default"
    return "Unspecified"


def moe_config(spec: DeploymentSpec) -> MoEConfig:
    """Build the config vLLM's rank 0 would build for this deployment."""
    par = spec.parallel
    world = par.tensor_parallel_size * par.data_parallel_size
    use_ep = world > 1 and par.enable_expert_parallel
    parallel = MoEParallelConfig(
        tp_size=1 if use_ep else world,
        dp_size=par.data_parallel_size,
        ep_size=world if use_ep else 1,
        use_ep=use_ep,
        all2all_backend=par.all2all_backend,
        enable_eplb=par.enable_eplb,
    )
    layer = spec.layer
    if layer.intermediate_size % parallel.tp_size:
        raise InvalidSpecError.single(
            "layer.intermediate_size",
            f"{layer.intermediate_size} is not divisible by the tensor-parallel degree "
            f"{parallel.tp_size} (tensor_parallel_size x data_parallel_size without expert "
            "parallelism)",
        )
    return MoEConfig(
        num_experts=layer.num_experts,
        experts_per_token=layer.top_k,
        hidden_dim=layer.hidden_size,
        intermediate_size_per_partition=layer.intermediate_size // parallel.tp_size,
        activation=layer.activation,
        is_act_and_mul=layer.is_gated,
        in_dtype=layer.dtype,
        router_logits_dtype=layer.routing.router_logits_dtype or layer.dtype,
        routing_method=routing_method(layer.routing),
        parallel=parallel,
        is_lora_enabled=spec.lora,
        moe_backend=spec.moe_backend,
    )
