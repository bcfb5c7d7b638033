"""The parity grid: deployment specs that exercise every rule of vLLM's WNA16 MoE decision.

Kept in the repo so the grid can be regenerated and re-checked for a later vLLM release:
`python -m tests.parity.grid > grid.jsonl` writes it as normalised JSON Lines (every field
explicit, platforms resolved), the form the vLLM reference runner reads.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterator
from typing import Any

from service.oracle import PLATFORM_PRESETS, parse_deployment

#: Real model shapes: (num_experts, hidden, intermediate, top_k).
MODEL_SHAPES = {
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
}
#: Shapes that fail Marlin's layer check (intermediate not a multiple of the group; hidden not
#: a multiple of 128) and one with too many experts for Triton's alignment kernel.
EDGE_SHAPES = {
    "marlin-bad-intermediate": (8, 2048, 1000, 2),
    "marlin-bad-hidden": (16, 2000, 1024, 2),
    "many-experts": (1024, 1024, 512, 8),
}


def _gptq(bits: int = 4, group: int = 128, **extra: Any) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": False,
        "sym": True,
        **extra,
    }


def _awq(bits: int = 4, group: int = 128, zero_point: bool = True) -> dict[str, Any]:
    return {
        "quant_method": "awq",
        "bits": bits,
        "group_size": group,
        "zero_point": zero_point,
        "version": "gemm",
    }


def _ct(
    bits: int = 4,
    group: int | None = 128,
    *,
    symmetric: bool = True,
    strategy: str = "group",
    actorder: str | None = None,
    ignore: tuple[str, ...] = ("lm_head",),
) -> dict[str, Any]:
    weights = {
        "num_bits": bits,
        "type": "int",
        "strategy": strategy,
        "group_size": group,
        "symmetric": symmetric,
        "actorder": actorder,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": list(ignore),
    }


#: Quantization variants: (label, hf config, vLLM --quantization flag).
QUANT_VARIANTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("gptq-int4-g128", _gptq(), None),
    ("gptq-int4-g32", _gptq(group=32), None),
    ("gptq-int4-g64", _gptq(group=64), None),
    ("gptq-int8-g128", _gptq(bits=8), None),
    ("gptq-int4-channel-descact", _gptq(group=-1, desc_act=True), None),
    ("gptq-int4-descact", _gptq(desc_act=True), None),
    ("gptq-int4-asym", _gptq(sym=False), None),
    ("gptq-dynamic-skip-experts", _gptq(dynamic={"-:.*experts.*": {}}), None),
    ("gptq-dynamic-int8-experts", _gptq(dynamic={"+:.*mlp.*": {"bits": 8}}), None),
    ("gptq-marlin-flag", _gptq(), "gptq_marlin"),
    ("gptq-as-moe-wna16", _gptq(), "moe_wna16"),
    ("gptq-g32-as-moe-wna16", _gptq(group=32), "moe_wna16"),
    ("gptq-int8-as-moe-wna16", _gptq(bits=8), "moe_wna16"),
    ("gptq-with-awq-flag", _gptq(), "awq"),
    ("awq-int4-g128", _awq(), None),
    ("awq-int4-g64-nozp", _awq(group=64, zero_point=False), None),
    ("awq-int8", _awq(bits=8), None),
    ("awq-as-moe-wna16", _awq(), "moe_wna16"),
    ("ct-int4-g128", _ct(), None),
    ("ct-int4-g32", _ct(group=32), None),
    ("ct-int4-asym-g128", _ct(symmetric=False), None),
    ("ct-int4-asym-g32", _ct(group=32, symmetric=False), None),
    ("ct-int8-channel", _ct(bits=8, group=None, strategy="channel"), None),
    ("ct-int4-channel", _ct(group=None, strategy="channel"), None),
    ("ct-int8-g128", _ct(bits=8), None),
    ("ct-int3-g128", _ct(bits=3), None),
    ("ct-int4-actorder-group", _ct(actorder="group"), None),
    ("ct-int4-actorder-dynamic", _ct(actorder="dynamic"), None),
    ("ct-ignore-experts", _ct(ignore=("lm_head", "re:.*experts.*")), None),
]

FORCED_BACKENDS = (
    "auto",
    "triton",
    "marlin",
    "humming",
    "emulation",
    "flashinfer_trtllm",
    "rdna3",
    "cutlass",
)
#: `--moe-backend` spellings as a user types them: vLLM's parser lower-cases them and turns
#: `-` into `_` before checking KernelConfig's names; some are KernelConfig names the WNA16
#: selection refuses (`deep_gemm`, `aiter`, `flydsl`), some are no KernelConfig name at all.
SPELLED_BACKENDS = (
    "TRITON",
    "Marlin",
    "HUMMING",
    "AUTO",
    "flashinfer-trtllm",
    "FlashInfer-TRTLLM",
    "RDNA3",
    "deep_gemm",
    "DEEP-GEMM",
    "batched-triton",
    "aiter",
    "flydsl",
    "bogus",
    "triton ",
    "-triton",
    "marlin_moe",
)


def _platforms() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, profile in PLATFORM_PRESETS.items():
        yield name, profile.to_json()
    h200 = PLATFORM_PRESETS["h200"].to_json()
    yield "h200-no-packages", {**h200, "packages": []}
    yield "h200-batch-invariant", {**h200, "env": {"VLLM_BATCH_INVARIANT": "1"}}
    a100 = PLATFORM_PRESETS["a100"].to_json()
    yield "a100-batch-invariant", {**a100, "env": {"VLLM_BATCH_INVARIANT": "1"}}
    yield (
        "a100-no-packages-batch-invariant",
        {**a100, "packages": [], "env": {"VLLM_BATCH_INVARIANT": "1"}},
    )
    b200 = PLATFORM_PRESETS["b200"].to_json()
    yield "b200-flashinfer-int4", {**b200, "env": {"VLLM_USE_FLASHINFER_MOE_INT4": "1"}}
    yield (
        "h100-humming-grouped",
        {**PLATFORM_PRESETS["h100"].to_json(), "env": {"VLLM_HUMMING_MOE_GEMM_TYPE": "grouped"}},
    )
    yield (
        "l40s-marlin-fp8",
        {**PLATFORM_PRESETS["l40s"].to_json(), "env": {"VLLM_MARLIN_INPUT_DTYPE": "fp8"}},
    )
    yield "a100-marlin-fp8", {**a100, "env": {"VLLM_MARLIN_INPUT_DTYPE": "fp8"}}
    yield "cpu-zentorch", {**PLATFORM_PRESETS["cpu"].to_json(), "packages": ["triton", "zentorch"]}


def _layer(shape: tuple[int, int, int, int], **extra: Any) -> dict[str, Any]:
    experts, hidden, intermediate, top_k = shape
    return {
        "num_experts": experts,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "top_k": top_k,
        **extra,
    }


def _spec(
    label: str,
    quant: dict[str, Any],
    flag: str | None,
    platform: dict[str, Any],
    layer: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    raw = {
        "hf_quantization_config": quant,
        "quantization": flag,
        "layer": layer,
        "platform": platform,
        **extra,
    }
    spec = parse_deployment(raw).to_json()
    spec["id"] = label
    return spec


def generate() -> list[dict[str, Any]]:
    """The whole grid, in a stable order, each spec with a unique id."""
    specs: list[dict[str, Any]] = []
    platforms = list(_platforms())
    shapes = {**MODEL_SHAPES, **EDGE_SHAPES}
    # 1. Every platform x every quantization x a real and two Marlin-failing shapes.
    for (pname, platform), (qname, quant, flag), sname in itertools.product(
        platforms,
        QUANT_VARIANTS,
        ("qwen1.5-moe-a2.7b", "marlin-bad-intermediate", "marlin-bad-hidden"),
    ):
        if qname == "ct-ignore-experts" and sname != "qwen1.5-moe-a2.7b":
            # An ignored layer is unquantized: vLLM then runs its unquantized MoE oracle,
            # which this library does not model, so one shape stands for it.
            continue
        specs.append(
            _spec(f"{pname}|{qname}|{sname}", quant, flag, platform, _layer(shapes[sname]))
        )
    # 2. Every forced backend on representative platforms and quantizations.
    forced_platforms = (
        "a100",
        "h200",
        "b200-flashinfer-int4",
        "mi300x",
        "gfx1100",
        "cpu",
        "xpu",
        "v100",
    )
    forced_quants = (
        "gptq-int4-g128",
        "awq-int4-g128",
        "ct-int4-g32",
        "ct-int4-asym-g128",
        "gptq-as-moe-wna16",
        "ct-int4-actorder-group",
    )
    platform_map = dict(platforms)
    quant_map = {q[0]: q for q in QUANT_VARIANTS}
    for backend, pname, qname in itertools.product(
        FORCED_BACKENDS, forced_platforms, forced_quants
    ):
        _, quant, flag = quant_map[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|forced-{backend}",
                quant,
                flag,
                platform_map[pname],
                _layer(MODEL_SHAPES["mixtral-8x7b"]),
                moe_backend=backend,
            )
        )
    # 2b. `--moe-backend` spellings: vLLM's parser normalises or refuses them.
    for name, pname, qname in itertools.product(
        SPELLED_BACKENDS, ("a100", "h200", "gfx1100", "cpu"), ("gptq-int4-g128", "ct-int4-g32")
    ):
        _, quant, flag = quant_map[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|spelled-{name!r}",
                quant,
                flag,
                platform_map[pname],
                _layer(MODEL_SHAPES["mixtral-8x7b"]),
                moe_backend=name,
            )
        )
    # 3. Every real model shape and the expert-count edge on the main GPUs.
    for pname, (qname, quant, flag), sname in itertools.product(
        ("a100", "h200", "b200-flashinfer-int4", "mi300x", "rtx5090"),
        [quant_map[q] for q in ("gptq-int4-g128", "ct-int4-g32", "awq-int4-g128")],
        (*MODEL_SHAPES, "many-experts"),
    ):
        specs.append(
            _spec(
                f"{pname}|{qname}|{sname}", quant, flag, platform_map[pname], _layer(shapes[sname])
            )
        )
    # 4. Layer and parallel variants: activations, bias, routing, LoRA, TP/EP/DP.
    variants: dict[str, dict[str, Any]] = {
        "swigluoai-bias": {
            "layer": _layer(MODEL_SHAPES["mixtral-8x7b"], activation="swigluoai", has_bias=True)
        },
        "silu-no-mul": {"layer": _layer(MODEL_SHAPES["mixtral-8x7b"], activation="silu_no_mul")},
        "relu2": {"layer": _layer(MODEL_SHAPES["mixtral-8x7b"], activation="relu2")},
        "situ": {"layer": _layer(MODEL_SHAPES["mixtral-8x7b"], activation="situ")},
        "gelu-fp16": {
            "layer": _layer(MODEL_SHAPES["mixtral-8x7b"], activation="gelu", dtype="float16")
        },
        # CPUExpertsInt4 took GELU_TANH from 0.33 on (0.32: SILU only).
        "gelu-tanh": {"layer": _layer(MODEL_SHAPES["mixtral-8x7b"], activation="gelu_tanh")},
        "deepseek-routing": {
            "layer": _layer(
                MODEL_SHAPES["deepseek-v3"],
                routing={
                    "scoring_func": "sigmoid",
                    "use_grouped_topk": True,
                    "num_expert_group": 8,
                    "topk_group": 4,
                    "e_score_correction_bias": True,
                    "routed_scaling_factor": 2.5,
                    "router_logits_dtype": "float32",
                },
            )
        },
        "softmax-no-renorm-fp32-logits": {
            "layer": _layer(
                MODEL_SHAPES["qwen1.5-moe-a2.7b"],
                routing={"renormalize": False, "router_logits_dtype": "float32"},
            )
        },
        "top1": {"layer": _layer((16, 2048, 1024, 1))},
        "lora": {"layer": _layer(MODEL_SHAPES["mixtral-8x7b"]), "lora": True},
        "tp2": {
            "layer": _layer(MODEL_SHAPES["mixtral-8x7b"]),
            "parallel": {"tensor_parallel_size": 2},
        },
        "tp4-marlin-bad": {
            "layer": _layer(MODEL_SHAPES["deepseek-v2-lite"]),
            "parallel": {"tensor_parallel_size": 4},
        },
        "ep2": {
            "layer": _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
            "parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
        },
        "dp2-ep-deepep-ll": {
            "layer": _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
            "parallel": {
                "data_parallel_size": 2,
                "enable_expert_parallel": True,
                "all2all_backend": "deepep_low_latency",
            },
        },
        "dp2-ep-deepep-ht-eplb": {
            "layer": _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
            "parallel": {
                "data_parallel_size": 2,
                "enable_expert_parallel": True,
                "all2all_backend": "deepep_high_throughput",
                "enable_eplb": True,
            },
        },
        "dp2-ep-fi-two-sided": {
            "layer": _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
            "parallel": {
                "data_parallel_size": 2,
                "enable_expert_parallel": True,
                "all2all_backend": "flashinfer_nvlink_two_sided",
            },
        },
        "dp2-ep-fi-one-sided": {
            "layer": _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
            "parallel": {
                "data_parallel_size": 2,
                "enable_expert_parallel": True,
                "all2all_backend": "flashinfer_nvlink_one_sided",
            },
        },
        # DeepEP v2 hands the experts padded rows from 0.34 on (standard before).
        "dp2-ep-deepep-v2": {"layer": _layer(MODEL_SHAPES["qwen3-30b-a3b"]), "parallel": DEEPEP_V2},
        # MiniMax2 routing (sigmoid scoring with a correction bias, no groups): 0.34's
        # Zentorch experts take it.
        "minimax2-routing": {
            "layer": _layer(
                MODEL_SHAPES["qwen3-30b-a3b"],
                routing={"scoring_func": "sigmoid", "e_score_correction_bias": True},
            )
        },
    }
    for pname, (qname, quant, flag), (vname, extra) in itertools.product(
        ("a100", "h200", "b200-flashinfer-int4", "mi300x", "cpu", "cpu-zentorch", "xpu"),
        [
            quant_map[q]
            for q in ("gptq-int4-g128", "ct-int4-g32", "gptq-as-moe-wna16", "ct-int4-asym-g32")
        ],
        variants.items(),
    ):
        if "eplb" in vname and platform_map[pname]["device"] == "cpu":
            continue  # vLLM refuses EPLB on CPU in config validation; the spec refuses it too
        specs.append(_spec(f"{pname}|{qname}|{vname}", quant, flag, platform_map[pname], **extra))
    specs.extend(_ct_asymmetric_widths(platform_map))
    specs.extend(_act_order_and_legacy_specs(platform_map))
    specs.extend(_kernel_list_and_width_specs(platform_map))
    specs.extend(_quark_specs(platform_map, variants))
    specs.extend(_startup_and_padded_specs(platform_map))
    unique: dict[str, dict[str, Any]] = {}
    for spec in specs:
        unique.setdefault(spec["id"], spec)
    return list(unique.values())


#: Asymmetric compressed-tensors bit widths besides 4 and 8, and where they are asked for.
CT_ASYMMETRIC_WIDTHS = (2, 3, 6)
CT_ASYMMETRIC_PLATFORMS = ("a100", "h200", "gfx1100", "cpu")


def _ct_asymmetric_widths(platforms: dict[str, dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Asymmetric compressed-tensors checkpoints of 2, 3 and 6 bits, grouped and per channel:
    vLLM 0.30 has zero-point types for 4 and 8 bits only (its MoE method raises KeyError),
    0.31 and later for every width from 2 to 8."""
    for pname, bits, group in itertools.product(
        CT_ASYMMETRIC_PLATFORMS, CT_ASYMMETRIC_WIDTHS, (128, None)
    ):
        strategy = "group" if group else "channel"
        quant = _ct(bits, group, symmetric=False, strategy=strategy)
        yield _spec(
            f"{pname}|ct-int{bits}-asym-{strategy}|qwen1.5-moe-a2.7b",
            quant,
            None,
            platforms[pname],
            _layer(MODEL_SHAPES["qwen1.5-moe-a2.7b"]),
        )


#: A shape whose intermediate size is a multiple of 32 but not of 64: Marlin fits it with
#: group 32 only when it may pad the thread tile, which act-order forbids.
TILE_PADDED_SHAPE = (8, 2048, 1056, 2)

#: Checkpoints with activation ordering in the forms releases up to 0.29 accept and later
#: ones refuse while parsing, plus the GPTQModel `dynamic` rules that switch it on.
ACT_ORDER_VARIANTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("gptq-int4-g32-descact", _gptq(group=32, desc_act=True), None),
    ("gptq-int4-g32", _gptq(group=32), None),
    ("gptq-dynamic-descact-experts", _gptq(dynamic={"+:.*experts.*": {"desc_act": True}}), None),
    (
        "gptq-channel-dynamic-descact",
        _gptq(group=-1, dynamic={"+:.*experts.*": {"desc_act": True}}),
        None,
    ),
    ("gptq-descact-as-moe-wna16", _gptq(desc_act=True), "moe_wna16"),
    ("gptq-channel-descact-as-moe-wna16", _gptq(group=-1, desc_act=True), "moe_wna16"),
    ("ct-int4-g32-actorder-group", _ct(group=32, actorder="group"), None),
    ("ct-int4-g32-actorder-dynamic", _ct(group=32, actorder="dynamic"), None),
    ("ct-int4-g32-actorder-weight", _ct(group=32, actorder="weight"), None),
    ("ct-int4-g32", _ct(group=32), None),
]
#: VLLM_HUMMING_MOE_GEMM_TYPE values: 0.29 reads the flag alone, later releases also ask
#: whether expert parallelism is on.
HUMMING_GEMM_ENVS = (None, "auto", "GROUPED", "grouped_contiguous", "indexed", "bogus")


def _act_order_and_legacy_specs(platforms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Scenarios for the rules releases before 0.30 have: activation ordering accepted
    (Marlin's strict tile shape, TRITON's act-order rules, the fall-backs), Humming's gemm
    type without expert parallelism's say, and act-order under every forced backend."""
    specs: list[dict[str, Any]] = []
    shapes = {
        "qwen1.5-moe-a2.7b": MODEL_SHAPES["qwen1.5-moe-a2.7b"],
        "tile-padded": TILE_PADDED_SHAPE,
    }
    for pname, (qname, quant, flag), (sname, shape) in itertools.product(
        ("a100", "h200", "mi300x", "gfx1100", "cpu", "xpu", "v100"),
        ACT_ORDER_VARIANTS,
        shapes.items(),
    ):
        specs.append(
            _spec(
                f"{pname}|{qname}|{sname}|act-order", quant, flag, platforms[pname], _layer(shape)
            )
        )
    quants = {q[0]: q for q in (*QUANT_VARIANTS, *ACT_ORDER_VARIANTS)}
    for backend, pname, qname in itertools.product(
        ("triton", "marlin", "humming", "emulation"),
        ("a100", "h200"),
        ("gptq-int4-descact", "gptq-int4-g32-descact", "ct-int4-g32-actorder-dynamic"),
    ):
        _, quant, flag = quants[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|tile-padded|forced-{backend}|act-order",
                quant,
                flag,
                platforms[pname],
                _layer(TILE_PADDED_SHAPE),
                moe_backend=backend,
            )
        )
    h200 = platforms["h200"]
    parallels = {
        "single": {},
        "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    }
    for env, (parallel_name, parallel), qname in itertools.product(
        HUMMING_GEMM_ENVS, parallels.items(), ("gptq-int4-g128", "ct-int4-g32")
    ):
        _, quant, flag = quants[qname]
        platform = {**h200, "env": {} if env is None else {"VLLM_HUMMING_MOE_GEMM_TYPE": env}}
        specs.append(
            _spec(
                f"h200-humming-gemm-{env}|{qname}|{parallel_name}|forced-humming",
                quant,
                flag,
                platform,
                _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
                moe_backend="humming",
                parallel=parallel,
            )
        )
    return specs


#: compressed-tensors and MoeWNA16 checkpoints on the edges of what the int4/int8-only
#: methods of releases up to 0.28 take: channel-wise with an explicit group size of -1
#: (where the per-channel variants above leave it unset), 8-bit asymmetric, 2-bit, and a
#: format other than pack-quantized.
WIDTH_VARIANTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("ct-int8-channel-explicit", _ct(bits=8, group=-1, strategy="channel"), None),
    ("ct-int4-channel-explicit", _ct(group=-1, strategy="channel"), None),
    (
        "ct-int8-asym-channel-explicit",
        _ct(bits=8, group=-1, strategy="channel", symmetric=False),
        None,
    ),
    ("ct-int2-g128", _ct(bits=2), None),
    ("ct-int4-g128-dense-format", {**_ct(), "format": "dense"}, None),
    ("gptq-int8-channel-as-moe-wna16", _gptq(bits=8, group=-1), "moe_wna16"),
]
#: Activations some releases' Humming and Triton WNA16 experts lack (SITU and
#: SWIGLUOAI_UNINTERLEAVE), beside one every kernel takes.
KERNEL_LIST_ACTIVATIONS = ("silu", "situ", "swigluoai_uninterleave")
#: Expert counts on both sides of Triton's padded-expert cap (rounded up to 32, < 1024).
EXPERT_COUNT_EDGES = (992, 993)


def _kernel_list_and_width_specs(platforms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Scenarios for what older releases' experts lists and integrations refuse: every
    quantization forced onto HUMMING (whose weight keys were a short list up to 0.28),
    HUMMING and TRITON forced with the activations their lists lacked, HUMMING under batch
    invariance (not declared before 0.28), the int4/int8-only widths, and the expert counts
    around Triton's cap (which 0.27 lacks)."""
    specs: list[dict[str, Any]] = []
    quants = {q[0]: q for q in (*QUANT_VARIANTS, *WIDTH_VARIANTS)}
    mixtral = _layer(MODEL_SHAPES["mixtral-8x7b"])
    for pname, (qname, quant, flag) in itertools.product(
        ("h200", "h200-batch-invariant"), quants.values()
    ):
        specs.append(
            _spec(
                f"{pname}|{qname}|forced-humming|kernel-lists",
                quant,
                flag,
                platforms[pname],
                mixtral,
                moe_backend="humming",
            )
        )
    for backend, pname, activation, qname in itertools.product(
        ("humming", "triton", "auto"),
        ("h200", "a100", "mi300x"),
        KERNEL_LIST_ACTIVATIONS,
        ("gptq-int4-g128", "ct-int4-g128", "ct-int4-g32", "gptq-as-moe-wna16"),
    ):
        _, quant, flag = quants[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|{activation}|forced-{backend}|kernel-lists",
                quant,
                flag,
                platforms[pname],
                _layer(MODEL_SHAPES["mixtral-8x7b"], activation=activation),
                moe_backend=backend,
            )
        )
    for pname, (qname, quant, flag), sname in itertools.product(
        ("a100", "h200", "mi300x", "gfx1100", "cpu", "cpu-zentorch", "xpu", "v100"),
        WIDTH_VARIANTS,
        ("qwen1.5-moe-a2.7b", "marlin-bad-intermediate"),
    ):
        shape = {**MODEL_SHAPES, **EDGE_SHAPES}[sname]
        specs.append(
            _spec(f"{pname}|{qname}|{sname}|widths", quant, flag, platforms[pname], _layer(shape))
        )
    for experts, backend, pname, qname in itertools.product(
        EXPERT_COUNT_EDGES,
        ("auto", "triton", "emulation"),
        ("a100", "mi300x"),
        ("gptq-int4-g128", "ct-int4-g32"),
    ):
        _, quant, flag = quants[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|experts-{experts}|forced-{backend}",
                quant,
                flag,
                platforms[pname],
                _layer((experts, 1024, 512, 8)),
                moe_backend=backend,
            )
        )
    return specs


def _quark(
    dtype: str = "int4",
    group: int | None = 128,
    *,
    symmetric: bool | None = True,
    pack_method: str | None = "reorder",
    **top: Any,
) -> dict[str, Any]:
    """An AMD Quark export's `quantization_config`, as Quark writes it (its export block,
    the global weight scheme with Quark's own fields); `top` replaces top-level keys."""
    weight: dict[str, Any] = {
        "dtype": dtype,
        "qscheme": "per_group" if group else "per_channel",
        "ch_axis": 1 if group else 0,
        "group_size": group,
        "symmetric": symmetric,
        "is_dynamic": False,
        "round_method": "half_even",
        "scale_type": "float",
    }
    export: dict[str, Any] = {
        "kv_cache_group": [],
        "min_kv_scale": 0.0,
        "weight_format": "real_quantized",
        "weight_merge_groups": None,
    }
    if pack_method is not None:
        export["pack_method"] = pack_method
    config: dict[str, Any] = {
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "export": export,
        "global_quant_config": {
            "weight": weight,
            "input_tensors": None,
            "output_tensors": None,
            "bias": None,
        },
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "kv_cache_quant_config": {},
        "exclude": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
    }
    return {**config, **top}


def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


_QUARK_G32_SYM = {"dtype": "int4", "qscheme": "per_group", "group_size": 32, "symmetric": True}
_FP8_OUTPUT = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}

#: Quark checkpoints whose routed experts are int4 weight-only (QuarkW4A16Int4MoEMethod
#: from 0.31, "Unsupported FusedMoe scheme" before), asked on every platform.
QUARK_VARIANTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("quark-int4-g128", _quark(), None),
    ("quark-uint4-asym-g32", _quark("uint4", 32, symmetric=False), None),
    (
        "quark-int4-g32-order-experts-only",
        _quark(
            pack_method="order",
            global_quant_config={"weight": None, "input_tensors": None, "output_tensors": None},
            layer_quant_config={"*mlp.experts*": {"weight": _QUARK_G32_SYM, "input_tensors": None}},
        ),
        None,
    ),
]
#: Quark configs on the edges of what vLLM's Quark accepts: refused while parsing, refused
#: by the MoE method, left unquantized, or looked up through its quirks.
QUARK_EDGE_VARIANTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("quark-int4-g128-flag", _quark(), "quark"),
    ("quark-with-gptq-flag", _quark(), "gptq"),
    ("quark-uint4-sym-g64", _quark("uint4", 64), None),
    ("quark-int4-asym-g128", _quark(symmetric=False), None),
    ("quark-int4-g16", _quark(group=16), None),
    ("quark-int4-channel", _quark(group=None), None),
    ("quark-int4-symmetric-null", _quark(symmetric=None), None),
    ("quark-int4-no-pack-method", _quark(pack_method=None), None),
    ("quark-int4-pack-bogus", _quark(pack_method="interleave"), None),
    (
        "quark-int4-fp8-input",
        _quark(
            global_quant_config={
                "weight": {**_QUARK_G32_SYM, "group_size": 128},
                "input_tensors": {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": True},
            }
        ),
        None,
    ),
    (
        "quark-int4-weight-list",
        _quark(global_quant_config={"weight": [_QUARK_G32_SYM], "input_tensors": []}),
        None,
    ),
    ("quark-global-weight-null", _quark(global_quant_config={"weight": None}), None),
    ("quark-exclude-experts", _quark(exclude=["lm_head", "re:.*experts.*"]), None),
    (
        "quark-exclude-expert-child",
        _quark(exclude=["lm_head", "model.layers.0.mlp.experts.0.down_proj"]),
        None,
    ),
    (
        "quark-layer-name-in-pattern",
        _quark(
            layer_quant_config={
                "model.layers.0.mlp.experts.0.down_proj": {"weight": _QUARK_G32_SYM}
            }
        ),
        None,
    ),
    (
        "quark-output-tensors",
        _quark(global_quant_config={"weight": _QUARK_G32_SYM, "output_tensors": _FP8_OUTPUT}),
        None,
    ),
    ("quark-no-export", _without(_quark(), "export"), None),
    (
        "quark-no-kv-cache-group",
        _quark(export={"pack_method": "reorder"}),
        None,
    ),
    ("quark-no-exclude", _without(_quark(), "exclude"), None),
    ("quark-no-layer-type-config", _without(_quark(), "layer_type_quant_config"), None),
    ("quark-no-layer-config", _without(_quark(), "layer_quant_config"), None),
    (
        "quark-kv-cache-fp8",
        _quark(
            export={"kv_cache_group": ["*k_proj", "*v_proj"], "pack_method": "reorder"},
            layer_quant_config={
                "*k_proj": {"weight": None, "output_tensors": _FP8_OUTPUT},
                "*v_proj": {"weight": None, "output_tensors": _FP8_OUTPUT},
            },
        ),
        None,
    ),
    (
        "quark-kv-cache-group-unmatched",
        _quark(export={"kv_cache_group": ["*k_proj"], "pack_method": "reorder"}),
        None,
    ),
    (
        "quark-kv-cache-empty",
        _quark(
            export={"kv_cache_group": ["*k_proj"], "pack_method": "reorder"},
            layer_quant_config={"*k_proj": {"weight": None, "output_tensors": None}},
        ),
        None,
    ),
]
#: A shape whose intermediate size per partition (80) no group >= 32 divides: Quark's
#: create_weights asserts at load (a hazard; the decision is vLLM's).
QUARK_HALVING_SHAPE = (8, 2048, 80, 2)


def _quark_specs(
    platforms: dict[str, dict[str, Any]], layer_variants: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """AMD Quark: its int4 weight-only configs on every platform and two shapes, every
    forced backend, the layer and parallel variants (EPLB, LoRA, batched all2all, non-gated,
    bias), and the configs vLLM's Quark refuses or reads through its quirks."""
    specs: list[dict[str, Any]] = []
    shapes = {
        "qwen1.5-moe-a2.7b": MODEL_SHAPES["qwen1.5-moe-a2.7b"],
        "marlin-bad-intermediate": EDGE_SHAPES["marlin-bad-intermediate"],
        "quark-halving": QUARK_HALVING_SHAPE,
    }
    for (pname, platform), (qname, quant, flag), (sname, shape) in itertools.product(
        platforms.items(), QUARK_VARIANTS, shapes.items()
    ):
        specs.append(_spec(f"{pname}|{qname}|{sname}", quant, flag, platform, _layer(shape)))
    mixtral = _layer(MODEL_SHAPES["mixtral-8x7b"])
    for pname, (qname, quant, flag) in itertools.product(
        ("a100", "h200", "mi300x", "cpu", "xpu", "v100"), QUARK_EDGE_VARIANTS
    ):
        specs.append(_spec(f"{pname}|{qname}|quark-edges", quant, flag, platforms[pname], mixtral))
    for backend, pname, (qname, quant, flag) in itertools.product(
        FORCED_BACKENDS,
        ("a100", "h200", "b200-flashinfer-int4", "mi300x", "gfx1100", "cpu"),
        QUARK_VARIANTS,
    ):
        specs.append(
            _spec(
                f"{pname}|{qname}|forced-{backend}",
                quant,
                flag,
                platforms[pname],
                mixtral,
                moe_backend=backend,
            )
        )
    for pname, (qname, quant, flag), (vname, extra) in itertools.product(
        ("a100", "h200", "b200-flashinfer-int4", "mi300x", "cpu"),
        QUARK_VARIANTS[:2],
        layer_variants.items(),
    ):
        if "eplb" in vname and platforms[pname]["device"] == "cpu":
            continue  # as above: vLLM refuses EPLB on CPU while validating its config
        specs.append(_spec(f"{pname}|{qname}|{vname}", quant, flag, platforms[pname], **extra))
    return specs


#: Data parallel with expert parallelism over DeepEP v2 (`--all2all-backend deepep_v2`).
DEEPEP_V2 = {
    "data_parallel_size": 2,
    "enable_expert_parallel": True,
    "all2all_backend": "deepep_v2",
}


def _startup_platforms(platforms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Machines some releases refuse while they build the engine config: removed or retired
    VLLM_* variables (0.34's `validate_environ`), and x86 CPUs without triton-cpu (0.34's CPU
    platform check; an Arm CPU without it is fine)."""
    a100, h200, cpu = platforms["a100"], platforms["h200"], platforms["cpu"]
    return {
        "a100-marlin-int8": {**a100, "env": {"VLLM_MARLIN_INPUT_DTYPE": "int8"}},
        "h200-model-runner-v1": {**h200, "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}},
        "h200-model-runner-v2": {**h200, "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}},
        "h200-runner-v2-marlin-fp8": {
            **h200,
            "env": {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_MARLIN_INPUT_DTYPE": "fp8"},
        },
        "cpu-no-triton": {**cpu, "packages": []},
        "cpu-zentorch-no-triton": {**cpu, "packages": ["zentorch"]},
        "cpu-arm-no-triton": {**cpu, "x86": False, "amx": False, "packages": []},
    }


def _startup_and_padded_specs(platforms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Scenarios for what 0.34 changed: start-up refusals ahead of (and instead of) the
    quantization path's, and DeepEP v2's padded rows under every forced backend that has an
    experts class declaring them or not."""
    specs: list[dict[str, Any]] = []
    quants = {q[0]: q for q in QUANT_VARIANTS}
    for (pname, platform), qname in itertools.product(
        _startup_platforms(platforms).items(),
        ("gptq-int4-g128", "ct-int4-g32", "awq-int4-g128", "gptq-int4-descact"),
    ):
        _, quant, flag = quants[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|qwen1.5-moe-a2.7b|startup",
                quant,
                flag,
                platform,
                _layer(MODEL_SHAPES["qwen1.5-moe-a2.7b"]),
            )
        )
    for backend, pname, qname in itertools.product(
        ("triton", "marlin", "humming", "emulation"),
        ("a100", "h200"),
        ("gptq-int4-g128", "ct-int4-g32"),
    ):
        _, quant, flag = quants[qname]
        specs.append(
            _spec(
                f"{pname}|{qname}|dp2-ep-deepep-v2|forced-{backend}",
                quant,
                flag,
                platforms[pname],
                _layer(MODEL_SHAPES["qwen3-30b-a3b"]),
                moe_backend=backend,
                parallel=DEEPEP_V2,
            )
        )
    return specs


def main() -> None:
    for spec in generate():
        sys.stdout.write(json.dumps(spec) + "\n")


if __name__ == "__main__":
    main()
