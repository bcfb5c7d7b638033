"""Every backend's verdict and reason for one `select_wna16_moe_backend` call, from vLLM's
own functions (`_get_priority_backends`, `map_wna16_backend`,
`_backend_incompatibility_reason`, `backend_to_kernel_cls`, each experts class's
`is_supported_config`), in the order and with the reach vLLM's selection has: with
`moe_backend` auto every backend of the priority list up to the first that fits is judged
(those after it are not reached); with a forced backend only that one is judged.

vLLM logs these reasons at debug level and keeps none of them; recomputing them after the
real call (with the same arguments, on the same platform) is how they are kept. Nothing here
re-states a vLLM rule. The parity harness (tests/parity/vllm_reference.py) takes its
candidates from here too, so what the plugin reports is what the parity records prove.
"""

from __future__ import annotations

from typing import Any, NamedTuple

SELECTED, REJECTED, NOT_REACHED = "selected", "rejected", "not_reached"


class Verdict(NamedTuple):
    backend: str
    verdict: str
    reason: str = ""


class Judged(NamedTuple):
    """One call's verdicts, the backend and experts class they select (None where none
    fits), and how the call asked: "auto", "forced", or "unknown" (a backend name that
    `map_wna16_backend` refuses)."""

    verdicts: list[Verdict]
    backend: Any
    experts_cls: Any
    mode: str


def _activation_format(mk: Any, config: Any) -> Any:
    """The activation format vLLM's selection hands each experts class: the MoE config's
    own `activation_format` where the release has one (0.34 and later, which adds
    `PaddedStandard` for DeepEP v2), else what older releases' selection derives from the
    parallel config (batched for DeepEP low-latency and NIXL EP, standard otherwise)."""
    own = getattr(type(config), "activation_format", None)
    if isinstance(own, property):
        return config.activation_format
    if config.moe_parallel_config.use_batched_activation_format:
        return mk.FusedMoEActivationFormat.BatchedExperts
    return mk.FusedMoEActivationFormat.Standard


def judge(iw: Any, backend: Any, arguments: dict[str, Any]) -> tuple[Any, str]:
    """The experts class vLLM's selection takes for `backend` in this call, or None and
    the reason it is refused."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    config = arguments["config"]
    reason = iw._backend_incompatibility_reason(
        backend,
        config,
        arguments["quant_config"],
        arguments["may_have_zp"],
        arguments["may_have_bias"],
        arguments["allow_tile_padding"],
    )
    if reason is not None:
        return None, reason
    activation_format = _activation_format(mk, config)
    last = None
    for cls in iw.backend_to_kernel_cls(backend):
        ok, last = cls.is_supported_config(
            cls, config, arguments["weight_key"], None, activation_format
        )
        if ok:
            return cls, ""
    return None, last or ""


def judged(iw: Any, arguments: dict[str, Any]) -> Judged:
    """The candidates of one call (`arguments`: its bound arguments, defaults applied), in
    the priority order of the platform the call ran on (`iw`: vLLM's int_wna16 module), and
    what they select."""
    priority = iw._get_priority_backends()
    requested = arguments["config"].moe_backend
    if requested == "auto":
        found: list[Verdict] = []
        chosen: tuple[Any, Any] = (None, None)
        for backend in priority:
            if chosen[1] is not None:
                found.append(Verdict(backend.name, NOT_REACHED))
                continue
            cls, reason = judge(iw, backend, arguments)
            if cls is not None:
                chosen = (backend, cls)
            found.append(Verdict(backend.name, REJECTED if cls is None else SELECTED, reason))
        return Judged(found, *chosen, "auto")
    try:
        forced = iw.map_wna16_backend(requested)
    except ValueError:
        return Judged([Verdict(b.name, NOT_REACHED) for b in priority], None, None, "unknown")
    cls, reason = judge(iw, forced, arguments)
    first = Verdict(forced.name, REJECTED if cls is None else SELECTED, reason)
    rest = [Verdict(b.name, NOT_REACHED) for b in priority if b != forced]
    return Judged([first, *rest], None if cls is None else forced, cls, "forced")


def verdicts(iw: Any, arguments: dict[str, Any]) -> list[Verdict]:
    """The candidates of one call (`judged`'s verdicts)."""
    return judged(iw, arguments).verdicts
