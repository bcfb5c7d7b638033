#!/usr/bin/env python
"""Build vLLM 0.33 MoE layers from a source checkpoint and from its converted copy.

Usage (in the vLLM environment, the plugin importable)::

    PYTHONPATH=plugin .venv-vllm/bin/python tests/plugin/checkpoint/vllm_loader.py CASE_DIR

``CASE_DIR/cases.json`` lists ``{"id", "source_dir", "converted_dir", "module", "backend",
"layer": {...}}``, optionally ``"sides"`` (default both), ``"moe_backend"`` (the
converted side's ``--moe-backend``, default auto), ``"env"`` (variables set for the
case) and ``"parallel"`` (``tensor_parallel_size`` etc., as the parity specs give them).
For each case, vLLM's own path runs twice on a faked CUDA platform (the parity harness's,
`tests/parity/vllm_reference.py`):

- source: the model's quantization config as vLLM resolves it, a real layer from
  `FusedMoEFactory` with ``--moe-backend`` forced to the case's backend (held at the
  checkpoint's module path), the per-expert checkpoint tensors through vLLM's
  `AutoWeightsLoader`, then vLLM's model-level `process_weights_after_loading` (for MARLIN
  with vLLM's CUDA-only repack replaced by its pure-torch reference,
  `tests/formats/vllm_cases/marlin.py`);
- converted: the converted directory's config.json through the same resolution (the
  ``moe_control`` method, registered by the plugin's `register()`), the same factory with
  ``--moe-backend auto``, the converted tensors through `AutoWeightsLoader`, then
  `process_weights_after_loading`.

Each side's registered parameters are written to ``<id>.<side>.safetensors``;
``results.json`` holds per case and side the MoE method class, the backend, the parameter
names and the method an attention projection gets (the converted side must give linear
layers the source's method), or the error (type and message) where vLLM or the plugin
refused.

Kept off the device: the kernel set-up after loading (`_setup_kernel`, which builds the
experts object the forward pass runs) is skipped on both sides alike, as the conversion
tests do: its prepare/finalize needs a distributed world and is not what is compared.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]


def _reference() -> Any:
    """The parity harness, imported from its file (it is a script, not a package)."""
    path = TESTS / "parity" / "vllm_reference.py"
    spec = importlib.util.spec_from_file_location("vllm_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_reference"] = module
    spec.loader.exec_module(module)
    return module


PLATFORM = {"device": "cuda", "capability": "9.0", "packages": [], "env": {}}
FORCED = {"TRITON": "triton", "EMULATION": "emulation", "MARLIN": "marlin"}


@contextmanager
def _repack(backend: str) -> Iterator[None]:
    if backend != "MARLIN":
        yield
        return
    sys.path.insert(0, str(TESTS / "formats"))
    from vllm_cases.marlin import repack_references

    with repack_references():
        yield


def _quant_config(reference: Any, directory: Path, dtype: str) -> tuple[Any, Any]:
    """vLLM's quantization config for the model in `directory`, as vLLM resolves it, and
    the model config (a stand-in with the attributes vLLM reads) it came from."""
    config = json.loads((directory / "config.json").read_text())
    spec = {
        "id": directory.name,
        "hf_quantization_config": config["quantization_config"],
        "quantization": None,
        "layer": {"dtype": dtype},
    }
    model_config = reference._model_config_stand_in(spec)
    model_config.model = str(directory)
    model_config.word_embeddings_untied_by_checkpoint = False
    reference._resolve_quantization(model_config)
    return reference._build_quant_config(model_config), model_config


def _tensors(directory: Path, module: str) -> dict[str, Any]:
    """The layer's tensors in `directory`, by their checkpoint names."""
    from safetensors import safe_open

    out = {}
    for file in sorted(p.name for p in directory.glob("*.safetensors")):
        with safe_open(str(directory / file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(module + "."):
                    out[name] = handle.get_tensor(name)
    return out


def _model_around(runner: Any, module: str, quant_config: Any) -> Any:
    """A module tree that holds `runner` at the checkpoint's module path, with the
    quantization config where vLLM's AutoWeightsLoader looks for it."""
    import torch

    root = torch.nn.Module()
    root.quant_config = quant_config
    parent = root
    *path, last = module.split(".")
    at = 0
    while at < len(path):
        if at + 1 < len(path) and path[at + 1].isdigit():  # "layers.3": a ModuleList
            index = int(path[at + 1])
            items = torch.nn.ModuleList([torch.nn.Module() for _ in range(index + 1)])
            parent.add_module(path[at], items)
            parent, at = items[index], at + 2
        else:
            child = torch.nn.Module()
            parent.add_module(path[at], child)
            parent, at = child, at + 1
    parent.add_module(last, runner)
    return root


def _build(reference: Any, case: dict[str, Any], quant_config: Any, moe_backend: str) -> Any:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    layer = case["layer"]
    parallel = case.get("parallel", {})
    vllm_config = reference._build_vllm_config({"parallel": parallel, "lora": False}, moe_backend)
    reference._World._apply_distributed(parallel)  # the stand-in groups of that size
    with set_current_vllm_config(vllm_config):
        runner = FusedMoEFactory(
            num_experts=layer["num_experts"],
            top_k=layer["top_k"],
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            params_dtype=getattr(torch, layer["dtype"]),
            quant_config=quant_config,
            prefix=case["module"],
            ckpt_names=("w1", "w2", "w3"),
        )
    return runner


def _linear_method(reference: Any, case: dict[str, Any], quant_config: Any) -> str:
    """The method class vLLM gives an attention projection under `quant_config`."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import ReplicatedLinear

    hidden = case["layer"]["hidden_size"]
    vllm_config = reference._build_vllm_config({"parallel": {}, "lora": False}, "auto")
    with set_current_vllm_config(vllm_config):
        linear = ReplicatedLinear(
            hidden,
            hidden,
            bias=False,
            params_dtype=getattr(torch, case["layer"]["dtype"]),
            quant_config=quant_config,
            prefix="model.layers.0.self_attn.o_proj",
        )
    return type(linear.quant_method).__name__


def _side(reference: Any, case: dict[str, Any], which: str, out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    directory = Path(case["source_dir" if which == "source" else "converted_dir"])
    backend = case["backend"]
    quant_config, model_config = _quant_config(reference, directory, case["layer"]["dtype"])
    moe_backend = FORCED[backend] if which == "source" else case.get("moe_backend", "auto")
    runner = _build(reference, case, quant_config, moe_backend)
    experts = runner.routed_experts
    method = experts.quant_method
    method._setup_kernel = lambda layer: None  # see the module doc
    # As a model's load_weights does: vLLM's AutoWeightsLoader (with the quantization
    # config's checkpoint mapper, which drops GPTQ's g_idx) over the checkpoint names, the
    # check DefaultModelLoader makes that every parameter was loaded, then vLLM's own
    # process_weights_after_loading over the model.
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.utils import AutoWeightsLoader

    model = _model_around(runner, case["module"], quant_config)
    expected = {name for name, _ in model.named_parameters()}
    loaded = AutoWeightsLoader(model).load_weights(_tensors(directory, case["module"]).items())
    with _repack(backend):
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    params = dict(experts.named_parameters(remove_duplicate=False))
    save_file(
        {name: p.detach().contiguous().clone() for name, p in params.items()},
        str(out / f"{case['id']}.{which}.safetensors"),
    )
    backend_attr = getattr(method, "wna16_backend", None) or method.wna16_moe_backend
    return {
        "linear_method": _linear_method(reference, case, quant_config),
        "ok": True,
        "quantization": quant_config.get_name(),
        "method": type(method).__name__,
        "backend": backend_attr.name,
        "loaded": sorted(loaded),
        "not_loaded": sorted(expected - loaded),
        "parameters": sorted(params),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(__doc__ or "")
        return 2
    case_dir = Path(argv[1])
    reference = _reference()
    reference._import_decision_path()
    world = reference._World()
    world.enter({"platform": PLATFORM, "parallel": {}})
    from moe_control_vllm.checkpoint import register

    register()
    results: dict[str, dict[str, Any]] = {}
    for case in json.loads((case_dir / "cases.json").read_text()):
        sides = case.get("sides", ["source", "converted"])
        results[case["id"]] = {}
        for which in sides:
            saved = {key: os.environ.get(key) for key in case.get("env", {})}
            os.environ.update(case.get("env", {}))
            try:
                result = _side(reference, case, which, case_dir)
            except Exception as raised:  # a refusal is a result, not a crash
                # The harness wraps what vLLM raised with the stage it raised in.
                error = getattr(raised, "error", raised)
                result = {
                    "ok": False,
                    "error_type": type(error).__name__,
                    "error": str(error),
                    "where": traceback.format_exc(limit=-3),
                }
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            results[case["id"]][which] = result
    (case_dir / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
