"""What would change the decision: the smallest changes of a fixed set that make a backend win.

`CHANGES` is the one table of what a user can change: install or remove a kernel package,
set or unset an environment flag vLLM reads, force or unforce `--moe-backend`, vLLM's
`--quantization moe_wna16`, a checkpoint property (activation ordering, symmetry, group
size), the parallel layout, LoRA, another GPU generation. Each row turns a spec into its
variant (or says it does not apply). `hints_for` re-decides every single change and then
every pair of changes of different kinds, with the engine itself (a decision costs tens of
microseconds), and keeps, for each backend that did not win, the smallest sets that make it
the winner, or, where none does, at least eligible (it passes every check of its own).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from service.oracle.decision import Change, ChangeHint
from service.oracle.engine import outcome
from service.oracle.platform import (
    KNOWN_PACKAGES,
    PACKAGE_DISTRIBUTIONS,
    PLATFORM_PRESETS,
)
from service.oracle.rulesets import DEFAULT_RULESET, get_ruleset
from service.oracle.spec import DeploymentSpec, ParallelSpec

#: At most this many change sets are kept per backend (the table's order decides which).
MAX_HINTS_PER_BACKEND = 3

Apply = Callable[[DeploymentSpec], DeploymentSpec | None]


@dataclass(frozen=True, slots=True)
class ChangeRule:
    """One row: the change, its dimension (two changes of one dimension never combine)
    and how it turns a spec into its variant (None: it does not apply to this spec)."""

    change: Change
    dimension: str
    apply: Apply


# --- platform ---------------------------------------------------------------------------


def _packages(spec: DeploymentSpec, packages: frozenset[str]) -> DeploymentSpec:
    platform = dataclasses.replace(spec.platform, packages=packages)
    return dataclasses.replace(spec, platform=platform)


#: Where each optional package matters (elsewhere installing it changes nothing).
_PACKAGE_DEVICES = {"humming": "cuda", "flashinfer": "cuda", "zentorch": "cpu", "triton": "cpu"}


def _install(package: str) -> Apply:
    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        p = spec.platform
        if p.has_package(package) or p.device != _PACKAGE_DEVICES[package]:
            return None
        return _packages(spec, p.packages | {package})

    return apply


def _remove(package: str) -> Apply:
    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        p = spec.platform
        return None if not p.has_package(package) else _packages(spec, p.packages - {package})

    return apply


def _env(name: str, value: str | None, device: str | None = None) -> Apply:
    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        p = spec.platform
        if p.env.get(name) == value or (device is not None and p.device != device):
            return None
        env = {k: v for k, v in p.env.items() if k != name}
        if value is not None:
            env[name] = value
        platform = dataclasses.replace(p, env=MappingProxyType(env))
        return dataclasses.replace(spec, platform=platform)

    return apply


def _describe(name: str) -> str:
    """A preset as a user names another GPU generation: "a100 (cuda 8.0)"."""
    p = PLATFORM_PRESETS[name]
    assert p.capability is not None
    major, minor = p.capability
    return f"{name} ({p.device} {major}.{minor}{', ' + p.arch if p.arch else ''})"


def _gpu(name: str) -> Apply:
    target = PLATFORM_PRESETS[name]

    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        p = spec.platform
        if (p.device, p.capability, p.arch) == (target.device, target.capability, target.arch):
            return None
        same_kind = p.device == target.device
        platform = dataclasses.replace(
            target,
            packages=p.packages if same_kind else target.packages,
            env=p.env,
        )
        return dataclasses.replace(spec, platform=platform)

    return apply


# --- vLLM's flags -----------------------------------------------------------------------


def _moe_backend(name: str) -> Apply:
    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        return None if spec.moe_backend == name else dataclasses.replace(spec, moe_backend=name)

    return apply


def _quantization(name: str | None) -> Apply:
    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        if spec.quantization == name:
            return None
        return dataclasses.replace(spec, quantization=name)

    return apply


def _parallel(**fields: Any) -> Apply:
    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        current = dataclasses.asdict(spec.parallel)
        if all(current[k] == v for k, v in fields.items()):
            return None
        return dataclasses.replace(spec, parallel=ParallelSpec(**{**current, **fields}))

    return apply


def _lora_off(spec: DeploymentSpec) -> DeploymentSpec | None:
    return dataclasses.replace(spec, lora=False) if spec.lora else None


# --- the checkpoint ---------------------------------------------------------------------


def _ct_weights(config: Mapping[str, Any], **fields: Any) -> dict[str, Any] | None:
    """A compressed-tensors config with `fields` set in every group's weights."""
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping):
        return None
    changed = False
    new_groups: dict[str, Any] = {}
    for key, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping):
            merged = {**weights, **fields}
            changed = changed or merged != weights
            new_groups[key] = {**group, "weights": merged}
        else:
            new_groups[key] = group
    return {**config, "config_groups": new_groups} if changed else None


def _checkpoint(gptq: dict[str, Any], awq: dict[str, Any], ct: dict[str, Any]) -> Apply:
    """Set checkpoint fields per format (an empty dict: the change means nothing there)."""

    def apply(spec: DeploymentSpec) -> DeploymentSpec | None:
        config = spec.hf_quantization_config
        method = str(config.get("quant_method", "")).lower()
        new: dict[str, Any] | None = None
        if method == "gptq" and gptq:
            new = {**config, **gptq}
        elif method == "awq" and awq:
            keys = {
                ("q_group_size" if k == "group_size" and "q_group_size" in config else k): v
                for k, v in awq.items()
            }
            new = {**config, **keys}
        elif method == "compressed-tensors" and ct:
            new = _ct_weights(config, **ct)
        if new is None or new == dict(config):
            return None
        return dataclasses.replace(spec, hf_quantization_config=new)

    return apply


def _group(size: int) -> Apply:
    ct = (
        {"strategy": "channel", "group_size": None}
        if size == -1
        else {"strategy": "group", "group_size": size}
    )
    return _checkpoint({"group_size": size}, {"group_size": size}, ct)


# --- the table --------------------------------------------------------------------------

_USER_BACKENDS = tuple(get_ruleset(DEFAULT_RULESET).user_backends)
_FLAG_CHANGES: tuple[tuple[str, str, str | None], ...] = (
    ("VLLM_USE_FLASHINFER_MOE_INT4", "1", "cuda"),
    ("VLLM_BATCH_INVARIANT", "1", None),
    ("VLLM_HUMMING_MOE_GEMM_TYPE", "grouped", "cuda"),
    ("VLLM_HUMMING_MOE_GEMM_TYPE", "indexed", "cuda"),
    ("VLLM_CPU_INT4_W4A8", "0", "cpu"),
)
_GPU_GENERATIONS = ("a100", "l40s", "h100", "b200", "rtx5090", "mi300x", "gfx1100")


CHANGES: tuple[ChangeRule, ...] = (
    *(
        ChangeRule(
            Change("package", "platform.packages", f"+{p}", f"install {PACKAGE_DISTRIBUTIONS[p]}"),
            f"package:{p}",
            _install(p),
        )
        for p in KNOWN_PACKAGES
    ),
    *(
        ChangeRule(
            Change(
                "package", "platform.packages", f"-{p}", f"uninstall {PACKAGE_DISTRIBUTIONS[p]}"
            ),
            f"package:{p}",
            _remove(p),
        )
        for p in KNOWN_PACKAGES
    ),
    *(
        ChangeRule(
            Change("env", f"platform.env.{n}", v or "", f"set {n}={v}"), f"env:{n}", _env(n, v, d)
        )
        for n, v, d in _FLAG_CHANGES
    ),
    *(
        ChangeRule(Change("env", f"platform.env.{n}", "", f"unset {n}"), f"env:{n}", _env(n, None))
        for n in dict.fromkeys(n for n, _, _ in _FLAG_CHANGES)
    ),
    *(
        ChangeRule(
            Change("moe_backend", "moe_backend", b, f"--moe-backend {b}"),
            "moe_backend",
            _moe_backend(b),
        )
        for b in (*_USER_BACKENDS, "auto")
    ),
    ChangeRule(
        Change("quantization", "quantization", "moe_wna16", "--quantization moe_wna16"),
        "quantization",
        _quantization("moe_wna16"),
    ),
    ChangeRule(
        Change("quantization", "quantization", "", "no --quantization"),
        "quantization",
        _quantization(None),
    ),
    ChangeRule(
        Change(
            "checkpoint",
            "hf_quantization_config.desc_act",
            "false",
            "a checkpoint without activation reordering (desc_act=false)",
        ),
        "checkpoint:act_order",
        _checkpoint({"desc_act": False}, {}, {"actorder": None}),
    ),
    ChangeRule(
        Change(
            "checkpoint",
            "hf_quantization_config.sym",
            "true",
            "a symmetric checkpoint (no zero points)",
        ),
        "checkpoint:sym",
        _checkpoint({"sym": True}, {"zero_point": False}, {"symmetric": True}),
    ),
    ChangeRule(
        Change(
            "checkpoint",
            "hf_quantization_config.sym",
            "false",
            "an asymmetric checkpoint (with zero points)",
        ),
        "checkpoint:sym",
        _checkpoint({"sym": False}, {"zero_point": True}, {"symmetric": False}),
    ),
    *(
        ChangeRule(
            Change(
                "checkpoint",
                "hf_quantization_config.group_size",
                str(size),
                f"a checkpoint with group size {size}" if size > 0 else "a channel-wise checkpoint",
            ),
            "checkpoint:group_size",
            _group(size),
        )
        for size in (32, 64, 128, -1)
    ),
    ChangeRule(
        Change("parallel", "parallel.tensor_parallel_size", "2", "--tensor-parallel-size 2"),
        "parallel:tp",
        _parallel(tensor_parallel_size=2),
    ),
    ChangeRule(
        Change("parallel", "parallel.tensor_parallel_size", "1", "--tensor-parallel-size 1"),
        "parallel:tp",
        _parallel(tensor_parallel_size=1),
    ),
    ChangeRule(
        Change("parallel", "parallel.enable_expert_parallel", "true", "--enable-expert-parallel"),
        "parallel:ep",
        _parallel(enable_expert_parallel=True),
    ),
    ChangeRule(
        Change(
            "parallel", "parallel.enable_expert_parallel", "false", "no --enable-expert-parallel"
        ),
        "parallel:ep",
        _parallel(enable_expert_parallel=False, enable_eplb=False),
    ),
    ChangeRule(
        Change(
            "parallel",
            "parallel",
            "dp2+ep+deepep_low_latency",
            "--data-parallel-size 2 --enable-expert-parallel --all2all-backend deepep_low_latency",
        ),
        "parallel:ep",
        _parallel(
            data_parallel_size=2, enable_expert_parallel=True, all2all_backend="deepep_low_latency"
        ),
    ),
    ChangeRule(Change("lora", "lora", "false", "no --enable-lora"), "lora", _lora_off),
    *(
        ChangeRule(Change("platform", "platform", g, f"run on {_describe(g)}"), "platform", _gpu(g))
        for g in _GPU_GENERATIONS
    ),
)

#: Platform changes apply first, so a package or flag change lands on the new platform.
_APPLY_ORDER = sorted(range(len(CHANGES)), key=lambda i: CHANGES[i].change.kind != "platform")


def _variant(spec: DeploymentSpec, rules: tuple[int, ...]) -> DeploymentSpec | None:
    for index in sorted(rules, key=_APPLY_ORDER.index):
        changed = CHANGES[index].apply(spec)
        if changed is None:
            return None
        spec = changed
    return spec


def _pairs(singles: list[int]) -> Iterator[tuple[int, int]]:
    """Every pair of applicable changes of different dimensions."""
    for a, b in itertools.combinations(singles, 2):
        if CHANGES[a].dimension != CHANGES[b].dimension:
            yield a, b


def hints_for(spec: DeploymentSpec, ruleset: str, winner: str | None) -> tuple[ChangeHint, ...]:
    """For each backend of the platform's priority list but `winner`, the smallest change
    sets (one change, else two) that make it the winner, else at least eligible."""
    rules = get_ruleset(ruleset)
    targets = [b for b in rules.priority(spec.platform) if b != winner]
    outcomes: dict[tuple[int, ...], tuple[str | None, frozenset[str]]] = {}
    singles = [i for i, rule in enumerate(CHANGES) if rule.apply(spec) is not None]

    def judge(combo: tuple[int, ...]) -> tuple[str | None, frozenset[str]]:
        if combo not in outcomes:
            variant = _variant(spec, combo)
            outcomes[combo] = (None, frozenset()) if variant is None else outcome(variant, ruleset)
        return outcomes[combo]

    def found(target: str, combos: list[tuple[int, ...]], eligible: bool) -> list[ChangeHint]:
        hits = []
        for combo in combos:
            won, passing = judge(combo)
            if (target in passing) if eligible else (won == target):
                changes = tuple(CHANGES[i].change for i in combo)
                hits.append(ChangeHint(target, "eligible" if eligible else "selected", changes))
                if len(hits) == MAX_HINTS_PER_BACKEND:
                    break
        return hits

    one: list[tuple[int, ...]] = [(i,) for i in singles]
    two: list[tuple[int, ...]] = list(_pairs(singles))
    hints: list[ChangeHint] = []
    for target in targets:
        for combos, eligible in ((one, False), (two, False), (one, True), (two, True)):
            hits = found(target, combos, eligible)
            if hits:
                hints.extend(hits)
                break
    return tuple(hints)
