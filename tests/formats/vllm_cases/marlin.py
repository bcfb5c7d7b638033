"""vLLM 0.33.0's Marlin MoE conversion on CPU: the reference for our MARLIN writers.

vLLM repacks Marlin weights only with a CUDA op (`gptq_marlin_moe_repack`,
`awq_marlin_moe_repack`). Here both are replaced, for the duration of a case, by their
pure-torch reference: vLLM's own unpackers recover each expert's codes from the packed words
(`unpack_quantized_values_into_int32` along K for GPTQ/compressed-tensors, `unpack_cols` plus
the inverse AWQ order for AWQ), then `marlin_utils_test.marlin_weights` lays them out, which
is what vLLM's repack tests hold the CUDA op to. Up to vLLM 0.29 the GPTQ repack also
takes act-order's `perm` (the g_idx sort), which the reference applies as the CUDA op reads
it: output row k of each expert is input row ``perm[k]``. The fp8-activation code remap
(`marlin_int4_fp8_preprocess`, also CUDA-only) is replaced by the torch statement of it in
`marlin_utils_test.awq_marlin_quantize`. Everything else (padding, scale and zero-point
permutations, int8-activation scales, bias) is vLLM's code, run as is.

Cases:

- ``marlin_integration``: the ``wna16_convert`` case (checkpoint tensors through the
  integration's loaders and `process_weights_after_loading`) with the repack references in
  place; same spec, backend ``MARLIN`` or ``BATCHED_MARLIN``.
- ``marlin_convert``: `convert_to_wna16_moe_kernel_format` called directly, for what the
  integrations cannot be asked here (int8/fp8 activations, non-gated layers). Spec:
  ``source`` (gptq | awq | compressed-tensors), ``bits``, ``group_size``, ``sym``,
  ``input_dtype`` (null | "int8" | "fp8"). Inputs: canonical
  ``<w13|w2>.<codes|scales|zeros|bias>`` (codes uint8 [E, N, K], scales [E, N, G], real zero
  points uint8 [E, N, G]), packed here with vLLM's own packers (`pack_rows`, `pack_cols`,
  `awq_pack`) into what each integration hands over.
- ``marlin_repack``: `marlin_weights` per expert of ``codes`` (uint8 [E, N, K]) for spec
  ``bits`` and ``a8`` (the 8-bit-activation layout).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from vllm_cases import CaseOutput, register

AWQ_ORDER = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}
CONVERT_OUTPUTS = (
    "w13_qweight",
    "w2_qweight",
    "w13_scales",
    "w2_scales",
    "w13_qzeros",
    "w2_qzeros",
    "w13_input_global_scale",
    "w2_input_global_scale",
    "w13_bias",
    "w2_bias",
)
#: The conversion's outputs from vLLM 0.34, without the 8-bit activations' global scales.
CONVERT_OUTPUTS_WITHOUT_INPUT_SCALES = tuple(n for n in CONVERT_OUTPUTS if "input_global" not in n)


def _reference_repack(codes: torch.Tensor, bits: int, a8: bool) -> torch.Tensor:
    """K-first int32 codes [E, K, N] -> `marlin_weights` of each expert, stacked (releases
    before the 8-bit-activation layouts take no `is_a_8bit`)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )

    if a8 and len(inspect.signature(get_weight_perm).parameters) < 2:
        raise NotImplementedError("this release has no Marlin tile layout for 8-bit activations")
    a8_args: dict[str, Any] = {"is_a_8bit": True} if a8 else {}
    perm = get_weight_perm(bits, *([True] if a8 else []))
    size_k, size_n = int(codes.shape[1]), int(codes.shape[2])
    return torch.stack(
        [marlin_weights(q_w, size_k, size_n, bits, perm, **a8_args) for q_w in codes]
    )


def _gptq_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`gptq_marlin_moe_repack`'s arguments by name, for either signature: up to vLLM 0.29
    ``(b_q_weight, perm, size_k, size_n, num_bits)`` (perm int32 [E, K], empty without
    act-order), later ``(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False)``."""
    names = ["b_q_weight", "size_k", "size_n", "num_bits", "is_a_8bit"]
    if (len(args) > 1 and isinstance(args[1], torch.Tensor)) or "perm" in kwargs:
        names.insert(1, "perm")
    bound = {**dict(zip(names, args, strict=False)), **kwargs}
    bound.setdefault("perm", None)
    bound.setdefault("is_a_8bit", False)
    return bound


def _permuted(codes: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """The CUDA repack's act-order read (`gptq_marlin_repack`'s has_perm branch): output
    row k of expert e is input row ``perm[e, k]`` of the K-first codes [E, K, N]."""
    if perm is None or perm.numel() == 0:
        return codes
    return torch.stack([expert[order.long()] for expert, order in zip(codes, perm, strict=True)])


@contextmanager
def repack_references() -> Iterator[None]:
    """Swap vLLM's CUDA-only Marlin weight ops for pure-torch references."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        unpack_cols,
        unpack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    weight_types = {4: scalar_types.uint4b8, 8: scalar_types.uint8b128}

    def gptq(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = _gptq_arguments(args, kwargs)
        num_bits = bound["num_bits"]
        codes = torch.stack(
            [
                unpack_quantized_values_into_int32(w, weight_types[num_bits], 0)
                for w in bound["b_q_weight"]
            ]
        )
        assert tuple(codes.shape[1:]) == (bound["size_k"], bound["size_n"])
        return _reference_repack(_permuted(codes, bound["perm"]), num_bits, bound["is_a_8bit"])

    def awq(
        b_q_weight: torch.Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False
    ) -> torch.Tensor:
        undo = torch.argsort(torch.tensor(AWQ_ORDER[num_bits]))
        codes = torch.stack(
            [
                unpack_cols(w, num_bits, size_k, size_n)
                .reshape(-1, undo.numel())[:, undo]
                .reshape(size_k, size_n)
                for w in b_q_weight
            ]
        )
        return _reference_repack(codes, num_bits, is_a_8bit)

    def fp8_preprocess(
        qweight: torch.Tensor, qzeros_or_none: torch.Tensor | None = None, inplace: bool = False
    ) -> torch.Tensor:
        """`marlin_int4_fp8_preprocess` on int4 words: the remap `awq_marlin_quantize` states
        in torch (q - zp, or 15 - q where that is negative), zp = 8 without zero points."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        q = (qweight.unsqueeze(-1) >> shifts) & 0xF
        if qzeros_or_none is None:
            zp = torch.full_like(q, 8)
        else:
            group = qweight.shape[0] // qzeros_or_none.shape[0]
            zp = ((qzeros_or_none.unsqueeze(-1) >> shifts) & 0xF).repeat_interleave(group, 0)
        new = q - zp
        new[new < 0] = 15 - q[new < 0]
        words = (new << shifts).sum(-1, dtype=torch.int64).to(torch.uint32).view(torch.int32)
        if inplace:
            qweight.copy_(words)
            return qweight
        return words

    replaced = {
        "gptq_marlin_moe_repack": gptq,
        "awq_marlin_moe_repack": awq,
        "marlin_int4_fp8_preprocess": fp8_preprocess,
    }
    saved = {name: getattr(ops, name) for name in replaced if hasattr(ops, name)}
    for name, reference in replaced.items():
        setattr(ops, name, reference)
    try:
        yield
    finally:
        for name in replaced:
            if name in saved:
                setattr(ops, name, saved[name])
            else:
                delattr(ops, name)


@contextmanager
def _marlin_moe_config(spec: Mapping[str, Any]) -> Iterator[None]:
    """Give the ``wna16_convert`` case's MoE config the two sizes Marlin's support check
    (`check_moe_marlin_supports_config`, asserted by the compressed-tensors method) reads."""
    from vllm_cases import wna16

    plain = wna16._moe

    def moe(spec: Mapping[str, Any]) -> SimpleNamespace:
        config = plain(spec)
        config.hidden_dim = spec["hidden"]
        config.intermediate_size_per_partition_unpadded = spec["intermediate"]
        return config

    wna16._moe = moe
    try:
        yield
    finally:
        wna16._moe = plain


@register("marlin_integration")
def marlin_integration(spec: Mapping[str, Any], inputs: dict[str, torch.Tensor]) -> CaseOutput:
    from vllm_cases.wna16 import wna16_convert

    assert spec["backend"] in ("MARLIN", "BATCHED_MARLIN")
    with repack_references(), _marlin_moe_config(spec):
        return wna16_convert(spec, inputs)


@register("marlin_repack")
def marlin_repack(spec: Mapping[str, Any], inputs: dict[str, torch.Tensor]) -> CaseOutput:
    codes = inputs["codes"].to(torch.int32).transpose(1, 2).contiguous()
    return {"qweight": _reference_repack(codes, spec["bits"], spec["a8"])}, {}


def _per_expert(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.stack([fn(x[e], *args) for e in range(x.shape[0])])


def _handed_over(spec: Mapping[str, Any], inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Canonical tensors -> what the spec's integration passes to the conversion."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        awq_pack,
        pack_cols,
        pack_rows,
    )

    bits, source = spec["bits"], spec["source"]
    args: dict[str, Any] = {}
    for name in ("w13", "w2"):
        codes = inputs[f"{name}.codes"].to(torch.int32)
        scales = inputs[f"{name}.scales"]
        zeros = inputs.get(f"{name}.zeros")
        e, n, k = codes.shape
        groups = int(scales.shape[2])
        k_first = codes.transpose(1, 2).contiguous()
        if source == "awq":
            # AutoAWQ hands over its checkpoint layout: [E, K, N/pf], [E, G, N], [E, G, N/pf].
            assert zeros is not None, "AWQ always stores zero points"
            args[name] = _per_expert(awq_pack, k_first, bits, k, n)
            args[f"{name}_scale"] = scales.transpose(1, 2).contiguous()
            zp = zeros.to(torch.int32).transpose(1, 2).contiguous()
            args[f"{name}_qzeros"] = _per_expert(awq_pack, zp, bits, groups, n)
        else:
            # GPTQ qweight [K/pf, N] and compressed-tensors weight_packed [N, K/pf] hold the
            # same words; both integrations hand over the N-first form.
            args[name] = _per_expert(pack_rows, k_first, bits, k, n).transpose(1, 2).contiguous()
            args[f"{name}_scale"] = scales.contiguous()
            if source == "gptq":
                # vLLM 0.33 takes symmetric GPTQ only, whose v1 zero points store midpoint - 1.
                assert zeros is None
                zeros = torch.full((e, n, groups), (1 << (bits - 1)) - 1)
            if zeros is not None:
                zp = zeros.to(torch.int32).transpose(1, 2).contiguous()
                packed = _per_expert(pack_cols, zp, bits, groups, n)
                args[f"{name}_qzeros"] = packed.transpose(1, 2).contiguous()
        bias = inputs.get(f"{name}.bias")
        if bias is not None:
            args[f"{name}_bias"] = bias
    return args


def _quant_config(spec: Mapping[str, Any]) -> Any:
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    bits, group = spec["bits"], spec["group_size"]
    if spec["source"] == "gptq":
        return AutoGPTQConfig(bits, group, False, True, False, {}, {})
    if spec["source"] == "awq":
        return AutoAWQConfig(bits, group, True, False)
    return QuantizationArgs(
        num_bits=bits,
        group_size=None if group == -1 else group,
        strategy="channel" if group == -1 else "group",
        symmetric=spec["sym"],
    )


@register("marlin_convert")
def marlin_convert(spec: Mapping[str, Any], inputs: dict[str, torch.Tensor]) -> CaseOutput:
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
        WNA16MoEBackend,
        convert_to_wna16_moe_kernel_format,
    )

    hidden, inter = (int(d) for d in inputs["w2.codes"].shape[1:])
    group = spec["group_size"]
    layer = SimpleNamespace(
        intermediate_size_per_partition=inter,
        num_groups_w13=1 if group == -1 else hidden // group,
        num_groups_w2=1 if group == -1 else inter // group,
    )
    args = _handed_over(spec, inputs)
    input_dtype = {None: None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[spec["input_dtype"]]
    # 0.34 dropped the parameter with its 8-bit activation paths (and the two outputs).
    takes_dtype = "input_dtype" in inspect.signature(convert_to_wna16_moe_kernel_format).parameters
    if not takes_dtype and input_dtype is not None:
        raise NotImplementedError("this release has no Marlin path for 8-bit activations")
    with repack_references():
        result = convert_to_wna16_moe_kernel_format(
            WNA16MoEBackend.MARLIN,
            layer,
            _quant_config(spec),
            *([input_dtype] if takes_dtype else []),
            args["w13"],
            args["w2"],
            args["w13_scale"],
            args["w2_scale"],
            w13_qzeros=args.get("w13_qzeros"),
            w2_qzeros=args.get("w2_qzeros"),
            w13_bias=args.get("w13_bias"),
            w2_bias=args.get("w2_bias"),
        )
    assert result is not None
    names = CONVERT_OUTPUTS if takes_dtype else CONVERT_OUTPUTS_WITHOUT_INPUT_SCALES
    return dict(zip(names, result, strict=True)), {}
