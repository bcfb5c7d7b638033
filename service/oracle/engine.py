"""The decision engine: vLLM's `select_wna16_moe_backend`, evaluated over a ruleset.

It walks the same path a vLLM start-up takes for one MoE layer (method resolution, capability
gate, MoE method construction, backend selection, the method's own post-selection checks)
and records, for every backend of the priority list, the verdict and the reason vLLM gives or
would give, so users see why each alternative was not used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from service.oracle.decision import Candidate, Decision, Verdict
from service.oracle.errors import ErrorInfo, InvalidSpecError, SelectionError
from service.oracle.explain import explain_rejection, not_reached
from service.oracle.hazards import hazards_for
from service.oracle.kernel_config import parse_moe_backend
from service.oracle.moe_config import ROUTING_METHODS, MoEConfig, format_accepts, moe_config
from service.oracle.quant_method import OracleCall, OtherMethod
from service.oracle.quantization import build_moe_method
from service.oracle.release_inputs import refuse_unaccepted
from service.oracle.rulesets import DEFAULT_RULESET, get_ruleset
from service.oracle.rulesets.base import ExpertsClass, RuleContext, Ruleset
from service.oracle.spec import DeploymentSpec
from service.oracle.startup import environment_refusal

_KERNEL = "kernel does not support "
_TORCH_DTYPES = {
    "float32": "torch.float32",
    "bfloat16": "torch.bfloat16",
    "float16": "torch.float16",
}


def _class_rejection(
    ruleset: Ruleset, cls: ExpertsClass, ctx: RuleContext
) -> tuple[str, str] | None:
    """`FusedMoEExperts.is_supported_config` in vLLM's order, then the class's own checks."""
    moe, platform = ctx.moe, ctx.platform
    activation_format = ruleset.activation_format(moe)
    if not cls.supports_device(platform):
        return "DEVICE", f"{_KERNEL}current device {platform.device}"
    if not (moe.is_act_and_mul or cls.supports_no_act_and_mul):
        return "NON_GATED", f"{_KERNEL}no act_and_mul MLP layer"
    if moe.activation not in cls.activations:
        return "ACTIVATION", f"{_KERNEL}MoEActivation.{moe.activation.upper()} activation"
    if not cls.supports_quant_scheme(ctx.weight_key):
        return "QUANT_SCHEME", f"{_KERNEL}quantization scheme {ctx.weight_key.render()}xNone"
    if not cls.supports_parallel(moe.parallel):
        parallel = moe.parallel.render(ruleset.parallel_config_extra)
        return "PARALLEL_CONFIG", f"{_KERNEL}parallel config {parallel}"
    if cls.routing_methods is not None and moe.routing_method not in cls.routing_methods:
        number = ROUTING_METHODS[moe.routing_method]
        return "ROUTING_METHOD", f"{_KERNEL}routing method {number}"
    if cls.supports_router_logits is not None and not cls.supports_router_logits(
        moe.router_logits_dtype, moe.routing_method
    ):
        dtype = _TORCH_DTYPES[moe.router_logits_dtype]
        return "ROUTER_LOGITS_DTYPE", f"{_KERNEL}router logits dtype {dtype}"
    if not format_accepts(cls.activation_format, activation_format):
        return "ACTIVATION_FORMAT", f"{_KERNEL}('{activation_format}',) activation format"
    if ctx.env_bool("VLLM_BATCH_INVARIANT") and not cls.batch_invariant:
        return "BATCH_INVARIANCE", f"{_KERNEL}batch invariance"
    if moe.is_lora_enabled and not cls.lora:
        return "LORA", f"{_KERNEL}LoRA"
    for check in cls.extra_checks:
        rejection = check(ctx)
        if rejection is not None:
            return rejection
    return None


def evaluate_backend(
    ruleset: Ruleset, backend: str, ctx: RuleContext
) -> tuple[str | None, str, str]:
    """(experts class that would run, reason code, reason): a class name and no reason
    when the backend fits; otherwise the structural reason, or the last class's reason."""
    for rule in ruleset.structural_rules:
        if backend in rule.backends and rule.applies(ctx):
            return None, rule.code, rule.text(ctx)
    code, reason = "", ""
    for cls in ruleset.experts_classes[backend]:
        rejection = _class_rejection(ruleset, cls, ctx)
        if rejection is None:
            return cls.name, "", ""
        code, reason = rejection
    return None, code, reason


def _unsupported_message(backend: str, reason: str) -> str:
    base = f"WNA16 MoE backend '{backend}' does not support the deployment configuration"
    return f"{base} since {reason}." if reason else f"{base}."


def _rejected(backend: str, code: str, reason: str, ctx: RuleContext) -> Candidate:
    return Candidate(backend, Verdict.REJECTED, code, reason, explain_rejection(backend, code, ctx))


def _select_backend(
    ruleset: Ruleset, ctx: RuleContext, moe_backend: str
) -> tuple[str, str, tuple[Candidate, ...]]:
    """The backend, its experts class and every candidate; raises vLLM's errors.

    vLLM evaluates backends only until one fits (or only the forced one), so the backends
    after it are `not_reached` and carry no reason, as vLLM gives none."""
    order = ruleset.priority(ctx.platform)

    def unreached(
        backends: Iterable[str], winner: str | None, forced: str | None
    ) -> list[Candidate]:
        why = not_reached(winner, forced, moe_backend)
        return [Candidate(b, Verdict.NOT_REACHED, explanation=why) for b in backends]

    if moe_backend != "auto":
        forced = ruleset.user_backends.get(moe_backend)
        if forced is None:
            raise SelectionError(
                ErrorInfo(
                    "backend",
                    "ValueError",
                    f"moe_backend='{moe_backend}' is not supported for WNA16 MoE. "
                    f"Expected one of {list(ruleset.user_backends)}.",
                ),
                candidates=tuple(unreached(order, None, None)),
            )
        experts, code, reason = evaluate_backend(ruleset, forced, ctx)
        rest = unreached((b for b in order if b != forced), None, forced)
        if experts is None:
            raise SelectionError(
                ErrorInfo("backend", "ValueError", _unsupported_message(forced, reason)),
                candidates=(_rejected(forced, code, reason, ctx), *rest),
            )
        return forced, experts, (Candidate(forced, Verdict.SELECTED), *rest)

    candidates: list[Candidate] = []
    for index, backend in enumerate(order):
        experts, code, reason = evaluate_backend(ruleset, backend, ctx)
        if experts is not None:
            candidates.append(Candidate(backend, Verdict.SELECTED))
            candidates.extend(unreached(order[index + 1 :], backend, None))
            return backend, experts, tuple(candidates)
        candidates.append(_rejected(backend, code, reason, ctx))
    raise SelectionError(
        ErrorInfo(
            "backend",
            "NotImplementedError",
            "No WNA16 MoE backend supports the deployment configuration.",
        ),
        candidates=tuple(candidates),
    )


def _context(plan: OracleCall, spec: DeploymentSpec, moe: MoEConfig) -> RuleContext:
    return RuleContext(
        moe=moe,
        platform=spec.platform,
        weight_key=plan.weight_key,
        quant_config=plan.quant_config,
        may_have_zp=plan.may_have_zp,
        may_have_bias=plan.may_have_bias,
        allow_tile_padding=plan.allow_tile_padding,
        quantization=plan.quantization,
    )


def decide(spec: DeploymentSpec, ruleset_name: str = DEFAULT_RULESET) -> Decision:
    """The decision for a parsed spec; raises `SelectionError` where vLLM would fail,
    with the ruleset and the platform it was decided by and for."""
    ruleset = get_ruleset(ruleset_name)
    try:
        return _decide(spec, ruleset)
    except SelectionError as exc:
        exc.ruleset, exc.platform = ruleset.name, spec.platform
        raise


def _plan(
    spec: DeploymentSpec, ruleset: Ruleset
) -> tuple[DeploymentSpec, MoEConfig, OracleCall | OtherMethod]:
    """The start-up path up to the oracle call: the release's refusal of inputs it does not
    know, `vllm serve`'s --moe-backend parse (before anything else looks at the
    deployment), its check of the environment, the layer's MoE config and the quant method
    vLLM builds for it (the platform's check of the engine config on the way); raises
    vLLM's errors on the way."""
    refuse_unaccepted(spec, ruleset)
    backend_name = parse_moe_backend(spec.moe_backend, ruleset.kernel_config_moe_backends)
    spec = dataclasses.replace(spec, moe_backend=backend_name)
    refusal = environment_refusal(ruleset.startup, spec.platform)
    if refusal is not None:
        raise refusal
    moe = moe_config(spec)
    return spec, moe, build_moe_method(spec, moe, ruleset.integrations, ruleset.startup)


def _decide(spec: DeploymentSpec, ruleset: Ruleset) -> Decision:
    spec, moe, plan = _plan(spec, ruleset)
    if isinstance(plan, OtherMethod):
        return Decision(
            ruleset.name,
            plan.quantization,
            plan.moe_method,
            None,
            None,
            platform=spec.platform,
            explanation=plan.why,
        )
    assert isinstance(plan, OracleCall)
    ctx = _context(plan, spec, moe)
    try:
        backend, experts, candidates = _select_backend(ruleset, ctx, moe.moe_backend)
    except SelectionError as exc:
        exc.quantization, exc.moe_method = plan.quantization, plan.moe_method
        raise
    try:
        plan.after_selection(backend)
        if moe.parallel.enable_eplb and backend not in plan.eplb_backends:
            # RoutedExperts refuses EPLB for quant methods that do not implement it.
            raise SelectionError(
                ErrorInfo(
                    "moe_method", "NotImplementedError", f"EPLB is not supported {plan.moe_method}."
                )
            )
    except SelectionError as exc:
        exc.quantization, exc.moe_method = plan.quantization, plan.moe_method
        exc.candidates = candidates
        raise
    return Decision(
        ruleset=ruleset.name,
        quantization=plan.quantization,
        moe_method=plan.moe_method,
        backend=backend,
        experts_class=experts,
        weight_key=plan.weight_key.to_weight_key(),
        may_have_zp=plan.may_have_zp,
        may_have_bias=plan.may_have_bias,
        allow_tile_padding=plan.allow_tile_padding,
        candidates=candidates,
        hazards=hazards_for(spec, plan, backend, moe, ruleset.name),
        platform=spec.platform,
    )


def outcome(
    spec: DeploymentSpec, ruleset_name: str = DEFAULT_RULESET
) -> tuple[str | None, frozenset[str]]:
    """(the backend vLLM selects or None where it fails, the backends that pass every check
    of theirs): what the what-would-change search compares across variants."""
    ruleset = get_ruleset(ruleset_name)
    try:
        refuse_unaccepted(spec, ruleset)
    except InvalidSpecError:
        return None, frozenset()
    try:
        winner: str | None = _decide(spec, ruleset).backend
    except (SelectionError, InvalidSpecError):
        winner = None
    try:
        refusal = environment_refusal(ruleset.startup, spec.platform)
        if refusal is not None:
            raise refusal
        moe = moe_config(spec)
        plan = build_moe_method(spec, moe, ruleset.integrations, ruleset.startup)
    except (SelectionError, InvalidSpecError):
        return winner, frozenset()
    if not isinstance(plan, OracleCall):
        return winner, frozenset()
    ctx = _context(plan, spec, moe)
    return winner, frozenset(b for b in ruleset.priority(ctx.platform) if _fits(ruleset, b, ctx))


def _fits(ruleset: Ruleset, backend: str, ctx: RuleContext) -> bool:
    """Whether `backend` passes every check; a check that makes vLLM itself raise (a
    release's rule comparing a missing group size) does not pass."""
    try:
        return evaluate_backend(ruleset, backend, ctx)[0] is not None
    except SelectionError:
        return False


@dataclass(frozen=True, slots=True)
class BackendTrace:
    """Every check of one backend under one ruleset, not only the first that decides: the
    structural rule that rejects it (`rule`: code and vLLM's reason; None when none does),
    and each experts class it tries, in order, with its rejection (code and reason; None
    when the class fits). What the upgrade diff reads to say which rule moved an answer."""

    backend: str
    rule: tuple[str, str] | None
    classes: tuple[tuple[str, tuple[str, str] | None], ...]

    def class_rejection(self, name: str) -> tuple[str, str] | None:
        """The rejection of experts class `name` (None: it fits); KeyError when the
        backend does not try it."""
        return dict(self.classes)[name]

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.classes)


def trace_backend(spec: DeploymentSpec, ruleset_name: str, backend: str) -> BackendTrace | None:
    """`backend`'s checks for this deployment under a ruleset, each evaluated (vLLM stops
    at the first class that fits; a trace goes on). None where the deployment never
    reaches the WNA16 oracle under that ruleset (vLLM fails earlier, or builds another
    method) or the ruleset has no such backend."""
    ruleset = get_ruleset(ruleset_name)
    if backend not in ruleset.experts_classes:
        return None
    try:
        spec, moe, plan = _plan(spec, ruleset)
    except (SelectionError, InvalidSpecError):
        return None
    if not isinstance(plan, OracleCall):
        return None
    ctx = _context(plan, spec, moe)
    try:
        rule = next(
            (
                (r.code, r.text(ctx))
                for r in ruleset.structural_rules
                if backend in r.backends and r.applies(ctx)
            ),
            None,
        )
    except SelectionError as raised:  # a release's rule that makes vLLM itself raise
        rule = (raised.error.type, raised.error.message)
    classes = tuple(
        (cls.name, _class_rejection(ruleset, cls, ctx)) for cls in ruleset.experts_classes[backend]
    )
    return BackendTrace(backend, rule, classes)
