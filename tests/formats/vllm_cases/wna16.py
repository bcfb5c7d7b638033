"""vLLM's WNA16 MoE integrations, from checkpoint tensors to `convert_to_wna16_moe_kernel_format`.

Case ``wna16_convert`` runs, with vLLM 0.33.0's own code, what a server start does to one MoE
layer's experts: build the integration's config and MoE method (AutoGPTQ, AutoAWQ,
compressed-tensors WNA16, MoeWNA16; AMD Quark's through `QuarkConfig.get_quant_method`, as a
model's layer asks for it), `create_weights` on a layer, feed every per-expert checkpoint
tensor through vLLM's weight loaders (MoeWNA16's and Quark's converting loaders wrapped
around `RoutedExperts.weight_loader`), then `process_weights_after_loading`, which calls
`convert_to_wna16_moe_kernel_format` for the spec's backend. It returns the loaded layer
parameters (``param.<name>``: the stacked integration layout of the fact sheet's 8.2) and
the conversion's ten outputs (``out.<name>``).

Faked, and why: no GPU or distributed world exists here, so the backend *selection* is
replaced by the spec's backend (the oracle is tested elsewhere), the layer is a
`RoutedExperts` built without its constructor (only the attributes the loaders read: TP 1,
gated, no padding, identity expert map), the tensor-parallel group lookups of MoeWNA16's
loader answer rank 0 on CPU, MoeWNA16's AWQ capability check sees an SM90 GPU, and the
kernel set-up after conversion is skipped. Everything that touches a tensor is vLLM's.

Spec: ``integration`` (auto_gptq | auto_awq | compressed_tensors | moe_wna16 | quark),
``method`` (moe_wna16: gptq | awq; quark: its export's pack method), ``backend`` (a
`WNA16MoEBackend` name), ``bits``, ``group_size``, ``sym``, ``desc_act``, ``has_bias``,
``num_experts``, ``hidden``, ``intermediate``, ``params_dtype``. Inputs: per-expert tensors named
``<e>.<gate_proj|up_proj|down_proj>.<tensor>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from vllm_cases import CaseOutput, register

OUTPUT_NAMES = (
    "w13",
    "w2",
    "w13_scale",
    "w2_scale",
    "w13_qzeros",
    "w2_qzeros",
    "w13_input_global_scale",
    "w2_input_global_scale",
    "w13_bias",
    "w2_bias",
)
#: The conversion's outputs up to vLLM 0.29, which also returned the act-order tensors.
OUTPUT_NAMES_WITH_G_IDX = (
    *OUTPUT_NAMES[:4],
    "w13_g_idx",
    "w2_g_idx",
    "w13_g_idx_sort_indices",
    "w2_g_idx_sort_indices",
    *OUTPUT_NAMES[4:],
)
#: The conversion's outputs from vLLM 0.34, which dropped the two input global scales (the
#: 8-bit Marlin activations they served are gone).
OUTPUT_NAMES_WITHOUT_INPUT_SCALES = tuple(n for n in OUTPUT_NAMES if "input_global" not in n)
#: The conversion's output names by the length of the tuple a release returns.
OUTPUTS_BY_LENGTH = {
    len(names): names
    for names in (OUTPUT_NAMES, OUTPUT_NAMES_WITH_G_IDX, OUTPUT_NAMES_WITHOUT_INPUT_SCALES)
}
#: The SM count of the GPU the cases pretend to run on (an H100 SXM, compute capability 9.0).
FAKE_SM_COUNT = 132
PROJECTIONS = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}


def _backend(spec: Mapping[str, Any]) -> Any:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    return WNA16MoEBackend[spec["backend"]]


#: The routed-experts layer's name a Quark config is asked about.
QUARK_LAYER = "model.layers.0.mlp.experts"


def _moe(spec: Mapping[str, Any]) -> SimpleNamespace:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return SimpleNamespace(
        w13_num_shards=2,
        is_act_and_mul=True,
        has_bias=bool(spec["has_bias"]),
        activation=MoEActivation.SILU,
    )


def _auto_gptq(spec: Mapping[str, Any], layer: Any) -> tuple[Any, Any, str]:
    from vllm.model_executor.layers.quantization import auto_gptq

    config = auto_gptq.AutoGPTQConfig(
        spec["bits"], spec["group_size"], spec["desc_act"], spec["sym"], False, {}, {}
    )
    return auto_gptq, auto_gptq.AutoGPTQMoEMethod(config, _moe(spec)), "auto_gptq"


def _auto_awq(spec: Mapping[str, Any], layer: Any) -> tuple[Any, Any, str]:
    from vllm.model_executor.layers.quantization import auto_awq

    config = auto_awq.AutoAWQConfig(spec["bits"], spec["group_size"], not spec["sym"], False)
    return auto_awq, auto_awq.AutoAWQMoEMethod(config, _moe(spec)), "auto_awq"


def _compressed_tensors(spec: Mapping[str, Any], layer: Any) -> tuple[Any, Any, str]:
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as module,
    )

    channelwise = spec["group_size"] == -1
    args = QuantizationArgs(
        num_bits=spec["bits"],
        type="int",
        symmetric=spec["sym"],
        strategy="channel" if channelwise else "group",
        group_size=None if channelwise else spec["group_size"],
        actorder="group" if spec["desc_act"] else None,
    )
    method = module.CompressedTensorsWNA16MoEMethod(args, None, _moe(spec))
    return module, method, "compressed_tensors"


def _moe_wna16(spec: Mapping[str, Any], layer: Any) -> tuple[Any, Any, str]:
    from vllm.model_executor.layers.quantization import moe_wna16

    full = {
        "quant_method": spec["method"],
        "bits": spec["bits"],
        "group_size": spec["group_size"],
        "desc_act": spec["desc_act"],
    }
    if spec["method"] == "gptq":
        full["sym"] = spec["sym"]
    else:
        full["zero_point"] = not spec["sym"]
    config = moe_wna16.MoeWNA16Config.from_config(full)
    return moe_wna16, moe_wna16.MoeWNA16Method(config, _moe(spec)), "moe_wna16"


def _quark(spec: Mapping[str, Any], layer: Any) -> tuple[Any, Any, str]:
    """QuarkConfig.from_config on a Quark export's config, then the method the config
    builds for the routed-experts layer (a release without Quark's int4 weight-only method
    refuses the layer here, as it refuses a model's)."""
    from vllm.model_executor.layers.quantization.quark import quark, quark_moe

    # The method reads the MoE config from the layer (the others are handed `_moe`'s).
    vars(layer.moe_config).update(vars(_moe(spec)))
    weight = {
        "dtype": "int4" if spec["sym"] else "uint4",
        "qscheme": "per_group",
        "group_size": spec["group_size"],
        "symmetric": spec["sym"],
    }
    config = quark.QuarkConfig.from_config(
        {
            "quant_method": "quark",
            "export": {"kv_cache_group": [], "pack_method": spec["method"]},
            "global_quant_config": {"weight": weight, "input_tensors": None},
            "layer_quant_config": {},
            "layer_type_quant_config": {},
            "exclude": [],
        }
    )
    return quark_moe, config.get_quant_method(layer, QUARK_LAYER), "quark"


INTEGRATIONS: Mapping[str, Callable[[Mapping[str, Any], Any], tuple[Any, Any, str]]] = {
    "auto_gptq": _auto_gptq,
    "auto_awq": _auto_awq,
    "compressed_tensors": _compressed_tensors,
    "moe_wna16": _moe_wna16,
    "quark": _quark,
}


def _patch(module: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    old = getattr(module, name)
    setattr(module, name, value)
    undo.append(lambda: setattr(module, name, old))


def _layer(spec: Mapping[str, Any]) -> Any:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    layer = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.moe_config = SimpleNamespace(
        is_act_and_mul=True,
        tp_shard_with_padding=False,
        moe_parallel_config=SimpleNamespace(tp_size=1),
        tp_rank=0,
        tp_size=1,
        num_experts=spec["num_experts"],  # 0.34's weight loader bounds the expert id by it
    )
    # 0.34's weight loader adds the fused shared experts to that bound.
    layer.expert_map_manager = SimpleNamespace(num_fused_shared_experts=0)
    layer.shared_expert_online_loader = None  # 0.34: no shared experts loaded online
    layer._fused_shared_expert_quantizer = None
    layer._loaded_expert_biases = set()
    layer.intermediate_size_per_partition = spec["intermediate"]
    layer._map_global_expert_id_to_local_expert_id = lambda expert: expert
    return layer


@register("wna16_convert")
def wna16_convert(spec: Mapping[str, Any], inputs: dict[str, torch.Tensor]) -> CaseOutput:
    from vllm.model_executor.layers.quantization import moe_wna16

    undo: list[Callable[[], None]] = []
    try:
        backend = _backend(spec)
        factory = INTEGRATIONS[spec["integration"]]
        # The oracle is replaced by the spec's backend in whichever module calls it.
        from vllm.model_executor.layers.quantization import auto_awq, auto_gptq
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
            compressed_tensors_moe_wna16 as ct_module,
        )
        from vllm.model_executor.layers.quantization.quark import quark_moe

        for module in (auto_gptq, auto_awq, ct_module, moe_wna16, quark_moe):
            if hasattr(module, "select_wna16_moe_backend"):  # Quark's: from 0.31
                _patch(module, "select_wna16_moe_backend", lambda *a, **k: (backend, None), undo)
        capability = SimpleNamespace(to_int=lambda: 90)
        _patch(
            moe_wna16,
            "current_platform",
            SimpleNamespace(get_device_capability=lambda: capability),
            undo,
        )
        _patch(moe_wna16, "get_tp_group", lambda: SimpleNamespace(device="cpu"), undo)
        # Up to 0.29 the AWQ method sizes a Marlin workspace from the GPU's SM count.
        from vllm.model_executor.layers.quantization.utils import marlin_utils

        if hasattr(marlin_utils, "num_compute_units"):
            _patch(marlin_utils, "num_compute_units", lambda *a: FAKE_SM_COUNT, undo)
        _patch(moe_wna16, "get_tensor_model_parallel_rank", lambda: 0, undo)
        layer = _layer(spec)
        module, method, _name = factory(spec, layer)
        layer.quant_method = method
        layer.quant_config = getattr(method, "quant_config", None)
        dtype = getattr(torch, spec["params_dtype"])
        extra: dict[str, Any] = {}
        # Up to 0.29 act-order-capable methods also take the unsharded intermediate size;
        # the layer's own predicate says which (as RoutedExperts.__init__ asks it).
        needs_full = getattr(layer, "_needs_intermediate_size_param", None)
        if needs_full is not None and needs_full(method):
            extra["intermediate_size_full"] = spec["intermediate"]
        method.create_weights(
            layer,
            spec["num_experts"],
            spec["hidden"],
            spec["intermediate"],
            dtype,
            weight_loader=layer.weight_loader,
            **extra,
        )
        ignored = []
        for key, tensor in inputs.items():
            expert, projection, suffix = key.split(".")
            stem, shard = PROJECTIONS[projection]
            name = f"{stem}_{suffix}"
            param = getattr(layer, name, None)
            if param is None:
                ignored.append(key)  # vLLM's load_weights has no parameter for it
                continue
            param.weight_loader(param, tensor, f"experts.{name}", shard, int(expert))
        loaded = {f"param.{n}": p.data.clone() for n, p in layer.named_parameters()}

        captured: dict[str, Any] = {}
        convert = module.convert_to_wna16_moe_kernel_format

        def spy(*args: Any, **kwargs: Any) -> Any:
            result = convert(*args, **kwargs)
            captured["result"] = result
            return result

        _patch(module, "convert_to_wna16_moe_kernel_format", spy, undo)
        method._setup_kernel = lambda layer: None
        method.process_weights_after_loading(layer)
        result = captured["result"]
        outputs: dict[str, torch.Tensor | None] = dict(loaded)
        if result is not None:
            for name, value in zip(OUTPUTS_BY_LENGTH[len(result)], result, strict=True):
                outputs[f"out.{name}"] = value
        return outputs, {"ignored": sorted(ignored), "in_place": result is None}
    finally:
        for step in reversed(undo):
            step()
