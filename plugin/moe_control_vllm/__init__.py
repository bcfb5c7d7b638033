"""moe-control's vLLM plugin (a `vllm.general_plugins` entry point, loaded by vLLM in every
process): reports each distinct WNA16 MoE backend decision vLLM takes to a moe-control
server, which compares it with its own answer.

`register()` does nothing unless `MOE_CONTROL_REPORT_ADDRESS` is set. With it, it wraps
vLLM's `select_wna16_moe_backend` (and `get_quant_config`, to know the model) wherever they
are looked up, without importing vLLM; every report leaves on a background thread through a
bounded queue under a deadline. No failure of the plugin's (a bad setting, a server that is
down, slow, refusing or asks for another token, a bug of ours) reaches vLLM: each costs one
warning line at most.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from typing import Any

log = logging.getLogger("moe_control_vllm")

#: The functions observed: (module, function, what the observer does with each call).
SELECT_MODULE = "vllm.model_executor.layers.fused_moe.oracle.int_wna16"
QUANT_CONFIG_MODULE = "vllm.model_executor.model_loader.weight_utils"

_REGISTER_SECONDS: list[float] = []


class _Reporting:
    """The observer and its reporter, built at the first observed call (not in register():
    a vLLM process that builds no WNA16 MoE layer never imports them)."""

    def __init__(self, found: Any) -> None:
        self.settings = found
        self._parts: tuple[Any, Any] | None = None
        self._lock = threading.Lock()
        self._failed = False
        #: CPU seconds vLLM's threads spent in the plugin's observing (what it costs vLLM
        #: beyond register(); CPU time, so a busy machine does not inflate it).
        self.seconds = 0.0
        #: The longest one observed call took, in wall time (a call that waited for the
        #: server would show here).
        self.longest_s = 0.0

    def parts(self) -> tuple[Any, Any]:
        if self._parts is None:
            with self._lock:
                if self._parts is None:
                    from moe_control_vllm.observer import DecisionObserver
                    from moe_control_vllm.reporter import Reporter

                    # The reporter asks the observer who reports when it sends (the model
                    # may be known only by then); the observer hands it each new decision.
                    observer = DecisionObserver(self._submit)
                    self._parts = (observer, Reporter(self.settings, observer.process))
        return self._parts

    def _submit(self, decision: Any) -> None:
        self.parts()[1].submit(decision)

    def see_select(self, call: Any) -> None:
        self._timed(lambda: self.parts()[0].see_select(call))

    def see_quant_config(self, call: Any) -> None:
        self._timed(lambda: self.parts()[0].see_quant_config(call))

    def _timed(self, step: Any) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            step()
        finally:
            self.seconds += time.thread_time() - cpu
            self.longest_s = max(self.longest_s, time.perf_counter() - wall)

    def on_error(self, exc: Exception) -> None:
        if not self._failed:
            self._failed = True
            log.warning(
                "moe-control: could not record a WNA16 MoE decision (%s: %s); vLLM is not "
                "affected and later failures are not logged",
                type(exc).__name__,
                exc,
            )


_REPORTING: list[_Reporting] = []


def register() -> None:
    """vLLM's general-plugin hook (it may call it more than once per process)."""
    began = time.thread_time()
    _register_reporting()
    _REGISTER_SECONDS.append(time.thread_time() - began)
    _register_checkpoint_loading()


def register_seconds() -> float:
    """CPU seconds the reporting half of `register()` took in this process, in all."""
    return sum(_REGISTER_SECONDS)


def observe_seconds() -> float:
    """CPU seconds vLLM's threads spent in the plugin's observing in this process."""
    return _REPORTING[0].seconds if _REPORTING else 0.0


def longest_observe_seconds() -> float:
    """The longest wall time one observed call spent in the plugin in this process."""
    return _REPORTING[0].longest_s if _REPORTING else 0.0


def _register_reporting() -> None:
    if _REPORTING:
        return
    from moe_control_vllm import settings

    try:
        found = settings.from_environ()
    except settings.ReportSettingsError as exc:
        log.warning("moe-control: not reporting WNA16 MoE decisions: %s", exc)
        return
    if found is None:
        return
    from moe_control_vllm.patch import Target, install

    reporting = _Reporting(found)
    install(
        (
            Target(SELECT_MODULE, "select_wna16_moe_backend", reporting.see_select),
            Target(QUANT_CONFIG_MODULE, "get_quant_config", reporting.see_quant_config),
        ),
        reporting.on_error,
    )
    _REPORTING.append(reporting)


def reporting() -> tuple[Any, Any] | None:
    """(observer, reporter) of this process once it observed a call, else None (for tests
    and tools: the observer's `seconds` and `distinct`, the reporter's counts and `flush`)."""
    return _REPORTING[0].parts() if _REPORTING and _REPORTING[0]._parts else None


# --- Loading converted checkpoints ------------------------------------------------------
# The one call site of the converted-checkpoint quantization method: the package
# `moe_control_vllm.checkpoint` (built beside this one) registers it with vLLM through its
# own `register()`. Until that package is part of the distribution this is a no-op.
def _register_checkpoint_loading() -> None:
    if importlib.util.find_spec("moe_control_vllm.checkpoint") is None:
        return
    importlib.import_module("moe_control_vllm.checkpoint").register()
