"""The shape of a ruleset: vLLM's backend rules for one release, as data.

A ruleset lists the backends, the experts classes each one tries, every class's support
checks, the structural rules that reject a backend before its classes are tried, and the
priority order per platform. The engine (`service.oracle.engine`) evaluates any ruleset the
same way vLLM's `select_wna16_moe_backend` does, so a new vLLM release is a new table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from service.oracle.conversions import ConversionRules
from service.oracle.moe_config import MoEConfig, MoEParallelConfig
from service.oracle.platform import PlatformProfile
from service.oracle.quant_key import QuantKey
from service.oracle.quant_method import IntegrationRules, QuantConfig
from service.oracle.releases import Release
from service.oracle.startup import StartupRules

__all__ = [
    "Check",
    "ConversionRules",
    "ExpertsClass",
    "IntegrationRules",
    "Priority",
    "Release",
    "RuleContext",
    "Ruleset",
    "StartupRules",
    "StructuralRule",
]


@dataclass(frozen=True, slots=True)
class RuleContext:
    """Everything a structural rule or a support check may look at."""

    moe: MoEConfig
    platform: PlatformProfile
    weight_key: QuantKey
    quant_config: QuantConfig
    may_have_zp: bool
    may_have_bias: bool
    allow_tile_padding: bool
    #: The resolved quantization method ("auto_gptq", "moe_wna16", ...), for explanations.
    quantization: str = ""

    def env_bool(self, name: str, default: str = "0") -> bool:
        """vLLM's `bool(int(os.getenv(name, default)))`."""
        return bool(int(self.platform.env_flag(name, default) or default))


#: A check that returns a (reason_code, reason_text) pair when it rejects, else None.
Check = Callable[[RuleContext], tuple[str, str] | None]


@dataclass(frozen=True, slots=True)
class StructuralRule:
    """One line of `_backend_incompatibility_reason`: which backends, when, and why."""

    backends: frozenset[str]
    applies: Callable[[RuleContext], bool]
    code: str
    reason: str | Callable[[RuleContext], str]

    def text(self, ctx: RuleContext) -> str:
        return self.reason if isinstance(self.reason, str) else self.reason(ctx)


@dataclass(frozen=True, slots=True)
class ExpertsClass:
    """One experts class and what its `is_supported_config` accepts."""

    name: str
    supports_device: Callable[[PlatformProfile], bool]
    supports_no_act_and_mul: bool
    activations: frozenset[str]
    supports_quant_scheme: Callable[[QuantKey], bool]
    supports_parallel: Callable[[MoEParallelConfig], bool]
    activation_format: str = "standard"
    monolithic: bool = False
    #: Routing methods accepted (vLLM's RoutingMethodType names); None accepts all.
    routing_methods: frozenset[str] | None = None
    #: (router_logits_dtype, routing_method) -> supported; None accepts all.
    supports_router_logits: Callable[[str, str], bool] | None = None
    batch_invariant: bool = False
    lora: bool = False
    #: Checks a class adds after the common ones pass (its own `is_supported_config`).
    extra_checks: tuple[Check, ...] = ()


@dataclass(frozen=True, slots=True)
class Priority:
    """`_get_priority_backends`: the order backends are tried in, per device kind.

    CUDA and ROCm share `gpu`; on a CUDA device whose capability is in
    `humming_preferred_capabilities`, `prioritize_humming` moves HUMMING directly ahead of
    MARLIN (an empty set: the release has no `prioritize_humming`)."""

    gpu: tuple[str, ...]
    cpu: tuple[str, ...]
    xpu: tuple[str, ...]
    humming_preferred_capabilities: frozenset[int] = frozenset()

    def __call__(self, platform: PlatformProfile) -> tuple[str, ...]:
        if platform.device == "cpu":
            return self.cpu
        if platform.device == "xpu":
            return self.xpu
        order = list(self.gpu)
        if (
            platform.device == "cuda"
            and platform.capability_int in self.humming_preferred_capabilities
            and "HUMMING" in order
            and "MARLIN" in order
        ):
            order.remove("HUMMING")
            order.insert(order.index("MARLIN"), "HUMMING")
        return tuple(order)


@dataclass(frozen=True, slots=True)
class Ruleset:
    """vLLM's WNA16 MoE backend rules for one release."""

    name: str
    #: The vLLM releases it answers for and their pins (`releases.RELEASES[name]`).
    release: Release
    backends: tuple[str, ...]
    experts_classes: dict[str, tuple[ExpertsClass, ...]]
    structural_rules: tuple[StructuralRule, ...]
    #: Maps the user's `--moe-backend` string to a backend.
    user_backends: dict[str, str]
    #: Every name KernelConfig accepts for `moe_backend` (its `MoEBackend` literal).
    kernel_config_moe_backends: tuple[str, ...]
    priority: Priority
    #: `FusedMoEConfig`'s activation format: what the all2all prepare step hands the experts
    #: classes, whose `activation_format` must accept it (`moe_config.format_accepts`).
    activation_format: Callable[[MoEConfig], str]
    #: `ParallelConfig`'s `All2AllBackend` literal: the `--all2all-backend` values the release
    #: accepts (a spec naming another is refused under it, naming these).
    all2all_backends: tuple[str, ...]
    #: Every reason code an experts class's checks answer (the engine's common checks and
    #: the classes' own), declared so that metrics can list the codes before any decision.
    class_check_codes: tuple[str, ...] = ()
    #: The environment flags a spec may set under this release: those it reads for the
    #: decision (a subset of `platform.DECISION_ENV_FLAGS`) and the start-up flags
    #: (`platform.STARTUP_ENV_FLAGS`, which a release refuses at start-up or starts
    #: regardless of); a spec setting another is refused under it.
    env_flags: frozenset[str] = frozenset()
    #: What this release's quantization integrations do where releases differ.
    integrations: IntegrationRules = field(default_factory=IntegrationRules)
    #: How this release's weight conversions lay tensors out where releases differ.
    conversions: ConversionRules = field(default_factory=ConversionRules)
    #: Fields the release's `FusedMoEParallelConfig` has after `enable_eplb` that no spec
    #: sets, with the value every deployment has (its parallel-config reason prints them).
    parallel_config_extra: tuple[tuple[str, object], ...] = ()
    #: What the release refuses while it builds its engine configuration (stages
    #: `environment` and `platform`).
    startup: StartupRules = field(default_factory=StartupRules)

    @property
    def reason_codes(self) -> tuple[str, ...]:
        """Every reason code a rejection can carry: the class checks' and the structural
        rules', each once."""
        structural = (rule.code for rule in self.structural_rules)
        return tuple(dict.fromkeys((*self.class_check_codes, *structural)))
