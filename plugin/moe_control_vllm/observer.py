"""From one `select_wna16_moe_backend` call to one report: the call's inputs, the platform
and model as vLLM saw them, every backend's verdict, the outcome; once per distinct
decision per process (a 60-layer model that decides the same for every layer sends one).

The distinct decision is the deployment without the layer's name, the call's inputs and
its outcome: two layers that differ only by name are one decision, and a layer a skip list
treats differently is another. Seeing a decision again costs building its key (the
deployment's facts, a few dozen attribute reads) and nothing else; the verdicts are
computed for a new one only.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import socket
import sys
import threading
import types
from collections.abc import Callable
from importlib import metadata
from typing import Any

from moe_control_vllm.deployment import ModelFacts, deployment, facts_of, model_facts
from moe_control_vllm.patch import ObservedCall
from moe_control_vllm.record import Candidate, Decision, Process, WeightKey
from moe_control_vllm.verdicts import verdicts

#: How far up the stack the layer's `prefix` is looked for (the quant method's __init__,
#: get_quant_method, the layer's _get_quant_method).
_PREFIX_DEPTH = 8


@functools.cache
def _signature(real: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(real)


@functools.cache
def plugin_version() -> str:
    try:
        return metadata.version("moe-control-vllm")
    except metadata.PackageNotFoundError:
        return ""


def _layer_name(caller: types.FrameType | None) -> str:
    frame, depth = caller, 0
    while frame is not None and depth < _PREFIX_DEPTH:
        prefix = frame.f_locals.get("prefix")
        if isinstance(prefix, str) and prefix:
            return prefix
        frame, depth = frame.f_back, depth + 1
    return ""


def _caller_class(caller: types.FrameType | None) -> str:
    """The class of the vLLM method that called: the first frame up the stack that runs in
    a `vllm.*` module and has a `self` (another wrapper between it and the plugin's, say a
    profiler's, is passed over)."""
    frame, depth = caller, 0
    while frame is not None and depth < _PREFIX_DEPTH:
        owner = frame.f_locals.get("self")
        if owner is not None and str(frame.f_globals.get("__name__", "")).startswith("vllm."):
            return type(owner).__name__
        frame, depth = frame.f_back, depth + 1
    return ""


def _weight_key(key: Any) -> WeightKey:
    shape = key.scale.group_shape
    return WeightKey(
        dtype=str(key.dtype),
        scale_dtype=str(key.scale.dtype).removeprefix("torch."),
        group_shape=(int(shape[0]), int(shape[1])),
        symmetric=bool(key.symmetric),
    )


def _outcome(result: Any, error: BaseException | None) -> dict[str, Any]:
    if error is not None:
        return {"error": (type(error).__name__, str(error))}
    backend, experts_cls = result
    return {"backend": backend.name, "experts_class": experts_cls.__name__}


class DecisionObserver:
    """Turns observed calls into `Decision`s, each distinct one handed to `submit` once."""

    def __init__(self, submit: Callable[[Decision], None]) -> None:
        self._submit = submit
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        #: The model of the last quantization config vLLM built in this process.
        self.remembered: ModelFacts | None = None
        os.register_at_fork(after_in_child=self._seen.clear)

    @property
    def distinct(self) -> int:
        """Distinct decisions seen in this process."""
        return len(self._seen)

    def see_quant_config(self, call: ObservedCall) -> None:
        """get_quant_config(model_config, load_config): remember the model it was for."""
        model_config = call.args[0] if call.args else call.kwargs.get("model_config")
        if call.error is None and model_config is not None:
            self.remembered = facts_of(model_config)

    def see_select(self, call: ObservedCall) -> None:
        """One select_wna16_moe_backend call: report it unless this process already did."""
        bound = _signature(call.real).bind(*call.args, **call.kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        iw = sys.modules[call.real.__module__]
        facts = model_facts(self.remembered)
        layer_name = _layer_name(call.caller)
        spec = deployment(iw, arguments["config"], layer_name, facts)
        inputs = {
            "moe_method": _caller_class(call.caller),
            "integration": facts.quantization or "",
            "weight_key": _weight_key(arguments["weight_key"]),
            "may_have_zp": bool(arguments["may_have_zp"]),
            "may_have_bias": bool(arguments["may_have_bias"]),
            "allow_tile_padding": bool(arguments["allow_tile_padding"]),
            **_outcome(call.result, call.error),
        }
        unnamed = {**spec, "layer": {**spec["layer"], "name": None}}
        key = json.dumps([unnamed, repr(sorted(inputs.items()))], sort_keys=True)
        with self._lock:
            if key in self._seen:
                self._seen[key] += 1
                return
            self._seen[key] = 1
        candidates = tuple(
            Candidate(v.backend, v.verdict, v.reason) for v in verdicts(iw, arguments)
        )
        self._submit(
            Decision(
                layer_name=layer_name,
                deployment_json=json.dumps(spec, sort_keys=True),
                candidates=candidates,
                **inputs,
            )
        )

    def process(self) -> Process:
        """Who is reporting, as data."""
        vllm = sys.modules.get("vllm")
        facts = model_facts(self.remembered)
        return Process(
            host=socket.gethostname(),
            pod=os.environ.get("POD_NAME", ""),
            namespace=os.environ.get("POD_NAMESPACE", ""),
            pid=os.getpid(),
            vllm_version=str(getattr(vllm, "__version__", "")),
            plugin_version=plugin_version(),
            model=facts.model or "",
        )
