#!/usr/bin/env python
"""Builds WNA16 MoE layers through vLLM's real integration path with the moe-control plugin
loaded by vLLM's own plugin loader, in the vLLM environment (run by tests/plugin/driver.py).

Stdin: one JSON object, {"specs": [normalised deployment specs], "layers": N, "plugins":
"first" or "late"}. For each spec
the layer is built N times under the names ``model.layers.<i>.mlp.experts`` (one decision,
N layers), through the parity harness (`tests/parity/vllm_reference.py`: vLLM's own
quantization resolution, VllmConfig and FusedMoEFactory, only the machine faked). Stdout: one
JSON object with vLLM's answers, the time each layer took, what the plugin cost (its
register() and its time observing), how many reports the server had answered when the last
layer was built, and what its reporter did once flushed.

The plugin is loaded first, before the decision path is imported, as vLLM loads general
plugins early in every process (its wrapper goes in as vLLM's modules load), or with
"plugins": "late" after it (it then rebinds the function where it was imported by name).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).resolve().parents[1] / "parity" / "vllm_reference.py"
#: How long the reporter may take to send what it holds before the answer is printed.
FLUSH_S = float(os.environ.get("MOE_CONTROL_TEST_FLUSH_S", "10"))


def _harness() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_reference", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_reference"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    harness = _harness()
    out = harness._claim_stdout()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    request = json.loads(sys.stdin.read())

    from vllm.plugins import load_general_plugins

    late = request.get("plugins") == "late"
    if late:  # vLLM's modules are imported already: the plugin rebinds the function
        harness._import_decision_path()
    began = time.perf_counter()
    load_general_plugins()
    plugins_s = time.perf_counter() - began

    try:
        import moe_control_vllm
    except ImportError:  # not installed in this environment: vLLM runs without it
        moe_control_vllm = None

    if not late:
        harness._import_decision_path()
    world = harness._World()
    harness._install_select_recorder()
    harness._install_quant_config_marker()
    answers, layer_s = [], []
    for spec in request["specs"]:
        for index in range(int(request["layers"])):
            named = {
                **spec,
                "layer": {**spec["layer"], "name": f"model.layers.{index}.mlp.experts"},
            }
            began = time.perf_counter()
            answer = harness.answer(world, named)
            layer_s.append(time.perf_counter() - began)
            answers.append(answer)
    state = None if moe_control_vllm is None else moe_control_vllm.reporting()
    # What the server had answered (accepted or refused) by the time every layer was built.
    answered = None if state is None else state[1].sent + state[1].failed
    result: dict[str, Any] = {
        "answers": answers,
        "layer_s": layer_s,
        "plugins_s": plugins_s,
        "installed": moe_control_vllm is not None,
        "reporting": state is not None,
    }
    if state is not None:
        assert moe_control_vllm is not None
        observer, reporter = state
        began = time.perf_counter()
        flushed = reporter.flush(FLUSH_S)
        result.update(
            flush_s=time.perf_counter() - began,
            flushed=flushed,
            register_s=moe_control_vllm.register_seconds(),
            observe_s=moe_control_vllm.observe_seconds(),
            longest_observe_s=moe_control_vllm.longest_observe_seconds(),
            distinct=observer.distinct,
            answered_while_building=answered,
            sent=reporter.sent,
            failed=reporter.failed,
            dropped=reporter.dropped,
            sender_cpu_s=reporter.cpu_s,
        )
    out.write(json.dumps(result) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
