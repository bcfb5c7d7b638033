"""The exactness grid: which vLLM integration reads which checkpoint, and what to expect.

Shared by `test_exactness.py` (runs it against vLLM) and kept apart so the grid and the
table of expected outcomes read as data.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

E, H, INTER = 2, 256, 128

# integration -> (checkpoint layout it loads, stacked layout of its parameters)
INTEGRATIONS = {
    "auto_gptq": ("gptq", "gptq"),
    "auto_awq": ("awq", "awq"),
    "compressed_tensors": ("compressed-tensors", "compressed-tensors"),
    "moe_wna16/gptq": ("gptq", "moe_wna16"),
    "moe_wna16/awq": ("awq", "moe_wna16"),
    "quark/reorder": ("quark", "quark-loaded"),
    "quark/order": ("quark-order", "quark-loaded"),
}
#: The backends Quark's int4 weight-only layers are converted for besides TRITON and
#: EMULATION: those vLLM's oracle can pick for them whose conversion refuses Quark.
QUARK_REFUSING_BACKENDS = ("CPU", "HUMMING")


@dataclass(frozen=True)
class Case:
    integration: str
    backend: str
    bits: int
    group_size: int
    sym: bool
    act: bool
    bias: bool
    scale_dtype: str

    @property
    def id(self) -> str:
        parts = [
            self.integration.replace("/", "-"),
            self.backend,
            f"int{self.bits}",
            f"g{self.group_size}",
            "sym" if self.sym else "asym",
            *(["act"] if self.act else []),
            *(["bias"] if self.bias else []),
            self.scale_dtype,
        ]
        return "-".join(parts)

    @property
    def source(self) -> str:
        return INTEGRATIONS[self.integration][0]

    @property
    def stacked(self) -> str:
        return INTEGRATIONS[self.integration][1]

    def spec(self) -> dict[str, object]:
        integration, _, method = self.integration.partition("/")
        return {
            "integration": integration,
            "method": method or None,
            "backend": self.backend,
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.act,
            "has_bias": self.bias,
            "num_experts": E,
            "hidden": H,
            "intermediate": INTER,
            "params_dtype": self.scale_dtype,
        }

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.scale_dtype)  # type: ignore[no-any-return]

    @property
    def checker(self) -> str:
        """The `vllm_cases` function that runs the case in vLLM: Marlin's swaps the CUDA-only
        repack for its pure-torch reference; every other conversion is pure torch."""
        return "marlin_integration" if self.backend == "MARLIN" else "wna16_convert"


def _plain(integration: str, act: bool, bias: bool) -> bool:
    """Whether the integration can express the combination: AWQ has no act-order and
    MoeWNA16 registers no bias parameters."""
    source = INTEGRATIONS[integration][0]
    return not (act and source == "awq") and not (bias and integration.startswith("moe_wna16"))


def grid() -> list[Case]:
    """Every case, in a fixed order (each case's checkpoint is seeded by its place):
    TRITON and EMULATION over the whole space; XPU over int4 (its experts take int4 only);
    MARLIN's act-order layers of the integrations that have them (the releases that accept
    act-order sort it for Marlin; Marlin without act-order is `test_marlin_parity`'s)."""
    cases = []
    plain = [i for i in INTEGRATIONS if not i.startswith("quark")]
    for integration, backend, bits, group, sym, act, bias in itertools.product(
        plain,
        ("TRITON", "EMULATION"),
        (4, 8),
        (32, 64, 128, -1),
        (True, False),
        (False, True),
        (False, True),
    ):
        if not _plain(integration, act, bias):
            continue
        dtypes = ("float16", "bfloat16") if backend == "EMULATION" else ("float16",)
        for dtype in dtypes:
            cases.append(Case(integration, backend, bits, group, sym, act, bias, dtype))
    for integration, group, sym, act, bias in itertools.product(
        plain, (32, 64, 128, -1), (True, False), (False, True), (False, True)
    ):
        if _plain(integration, act, bias):
            cases.append(Case(integration, "XPU", 4, group, sym, act, bias, "float16"))
    for integration, bits, group, sym, bias in itertools.product(
        ("auto_gptq", "compressed_tensors"), (4, 8), (32, 64, 128), (True, False), (False, True)
    ):
        cases.append(Case(integration, "MARLIN", bits, group, sym, True, bias, "float16"))
    return [*cases, *_quark_cases()]


def _quark_cases() -> list[Case]:
    """AMD Quark's int4 exports (both pack methods), after the others so their seeds stay:
    TRITON and EMULATION over group sizes and symmetry, and the backends whose conversion
    refuses Quark. No XPU: vLLM's XPU platform does not list Quark."""
    quark = [i for i in INTEGRATIONS if i.startswith("quark")]
    cases = []
    for integration, backend, group, sym in itertools.product(
        quark, ("TRITON", "EMULATION"), (32, 64, 128, -1), (True, False)
    ):
        dtypes = ("float16", "bfloat16") if backend == "EMULATION" else ("float16",)
        for dtype in dtypes:
            cases.append(Case(integration, backend, 4, group, sym, False, False, dtype))
    for backend, group, sym in itertools.product(QUARK_REFUSING_BACKENDS, (32, 128), (True, False)):
        cases.append(Case("quark/reorder", backend, 4, group, sym, False, False, "float16"))
    return cases


@dataclass(frozen=True)
class Refused:
    """vLLM raises `error_type` with `message` in its text; we convert (or refuse) anyway."""

    error_type: str
    message: str
    why: str


@dataclass(frozen=True)
class Wrong:
    """vLLM converts without complaint but gets it wrong; the test shows how.

    `drops_g_idx`: vLLM's output is exactly ours for the layer without its act order;
    otherwise the test shows vLLM's weights differ from the checkpoint's.
    """

    why: str
    drops_g_idx: bool = False


@dataclass(frozen=True)
class Exact:
    """Bit for bit equal, except each listed departure (checked one by one)."""

    departures: tuple[str, ...] = ()


Expectation = Refused | Wrong | Exact


@dataclass(frozen=True)
class DropsActOrder:
    """The release accepts the act-order checkpoint and converts it as if it had none: the
    outcome is the same case's without act-order, and a conversion it completes is Wrong."""

    why: str


Rule = tuple[Callable[[Case], bool], Expectation | DropsActOrder]


def _one_group(case: Case) -> bool:
    """Some projection has a single scale group (channelwise, or group_size >= its K)."""
    return case.group_size == -1 or case.group_size >= min(H, INTER)


def _act(case: Case) -> bool:
    """Act-order that survives vLLM's normalisation (desc_act with one group is a no-op)."""
    return case.act and case.group_size != -1


def _off_marlin(case: Case) -> bool:
    """The case takes a non-Marlin path, where compressed-tensors' non-Marlin asserts are."""
    return case.backend != "MARLIN"


def _is(integration: str) -> Callable[[Case], bool]:
    return lambda case: case.integration.startswith(integration)


_QUARK = _is("quark")
GPTQ_INTEGRATION = ("auto_gptq", "moe_wna16/gptq")

# First match wins. Refusals are what vLLM 0.33.0 raises; Wrong is where it converts but
# the result is not the checkpoint's weights; Exact lists what we do differently on purpose.
RULES: tuple[Rule, ...] = (
    (
        lambda c: _QUARK(c) and c.group_size == -1,
        Refused(
            "ValueError",
            "Quark W4A16 weight.group_size must be a positive int, got -1",
            "Quark's int4 weight-only scheme needs a positive group size",
        ),
    ),
    (
        lambda c: _QUARK(c) and c.backend == "CPU",
        Refused(
            "TypeError",
            "CPU WNA16 MoE backend requires AutoAWQConfig, AutoGPTQConfig or "
            "QuantizationArgs, got QuarkConfig.",
            "vLLM's CPU conversion knows no Quark layout (hazard QUARK_CPU_TYPE_ERROR)",
        ),
    ),
    (
        lambda c: _QUARK(c) and c.backend == "EMULATION" and not c.sym,
        Refused(
            "RuntimeError",
            "is invalid for input of size",
            "vLLM's emulation unpacks Quark's uint8 zero points as int32 GPTQ words (hazard "
            "QUARK_EMULATION_MISREAD)",
        ),
    ),
    (
        lambda c: _QUARK(c) and c.backend == "EMULATION",
        Wrong(
            "vLLM's emulation treats Quark's loaded uint8 N-first bytes as int32 GPTQ words: "
            "w13 comes out [E, N, 4K] instead of [E, N, K] (hazard QUARK_EMULATION_MISREAD)"
        ),
    ),
    (
        lambda c: _QUARK(c) and c.backend == "HUMMING",
        Refused(
            "TypeError",
            "Humming WNA16 checkpoint schema requires AutoAWQConfig, AutoGPTQConfig or "
            "QuantizationArgs, got QuarkConfig.",
            "vLLM's Humming conversion knows no Quark layout (hazard "
            "QUARK_HUMMING_SCHEMA_TYPE_ERROR)",
        ),
    ),
    (
        lambda c: c.integration in GPTQ_INTEGRATION and _act(c),
        Refused(
            "ValueError",
            "desc_act=True) is no longer supported",
            "vLLM 0.33 refuses GPTQ act-order outright (gptq_utils); we read g_idx and write "
            "EMULATION (TRITON has no g_idx)",
        ),
    ),
    (
        lambda c: c.integration == "auto_gptq" and not c.sym,
        Refused(
            "ValueError",
            "Unsupported quantization config",
            "AutoGPTQConfig knows only uint4b8/uint8b128; asymmetric GPTQ loads through "
            "moe_wna16 (covered by the moe_wna16/gptq cases)",
        ),
    ),
    (
        lambda c: c.integration == "compressed_tensors" and c.act and c.group_size == -1,
        Refused("ValidationError", "Must use group", "compressed-tensors: actorder needs groups"),
    ),
    (
        lambda c: c.integration == "compressed_tensors" and c.group_size == -1 and _off_marlin(c),
        Refused(
            "AssertionError",
            "",
            "non-Marlin compressed-tensors WNA16 MoE asserts strategy == 'group' (R8)",
        ),
    ),
    (
        lambda c: c.integration == "auto_awq" and c.bits == 8,
        Refused("ValueError", "Unsupported num_bits = 8", "AutoAWQConfig is 4-bit only"),
    ),
    (
        lambda c: c.integration == "auto_awq" and c.group_size == -1,
        Refused("RuntimeError", "negative dimension", "AutoAWQ create_weights divides H by -1"),
    ),
    (
        lambda c: c.integration.startswith("moe_wna16") and c.group_size == -1,
        Refused(
            "RuntimeError",
            "must be non-negative",
            "MoeWNA16 create_weights divides H by -1 (vLLM issue #52715)",
        ),
    ),
    (
        lambda c: c.integration == "moe_wna16/awq" and c.bits == 8,
        Refused("AssertionError", "", "MoeWNA16's loader asserts 4-bit AWQ"),
    ),
    (
        lambda c: c.integration == "auto_gptq" and c.backend == "TRITON" and _one_group(c),
        Refused(
            "RuntimeError",
            "to view Int as Byte",
            "vLLM's TRITON zero-point repack calls .contiguous().view(uint8) on a "
            "[E, N/pf, 1] transpose whose size-1 last dim keeps a stride != 1 (AutoGPTQ "
            "passes qzeros even when symmetric)",
        ),
    ),
    (
        lambda c: (
            c.integration == "compressed_tensors"
            and c.backend == "EMULATION"
            and c.bits == 8
            and c.sym
        ),
        Wrong(
            "vLLM's emulation unpacks int4 only: each int8 word is read as eight nibbles, "
            "so w13 comes out [E, N, 2K]; we write int8 correctly"
        ),
    ),
    (
        lambda c: (
            c.integration in ("auto_gptq", "compressed_tensors")
            and c.backend == "EMULATION"
            and c.bits == 8
        ),
        Refused(
            "RuntimeError",
            "is invalid for input of size",
            "vLLM's emulation unpacks int4 only (here the zero points fail to reshape); we "
            "write int8 correctly",
        ),
    ),
    (
        lambda c: c.integration.startswith("moe_wna16") and c.backend == "EMULATION" and not c.sym,
        Refused(
            "RuntimeError",
            "is invalid for input of size",
            "vLLM's emulation unpacks MoeWNA16's uint8 zero points as int32 GPTQ words",
        ),
    ),
    (
        lambda c: c.integration.startswith("moe_wna16") and c.backend == "EMULATION",
        Wrong(
            "vLLM's emulation treats MoeWNA16's uint8 N-first bytes as int32 GPTQ words: "
            "w13 comes out [E, N, 4K] (int4) instead of [E, N, K]"
        ),
    ),
    (
        lambda c: c.integration == "auto_awq" and c.backend == "TRITON",
        Wrong(
            "vLLM's oracle never picks TRITON for AutoAWQ; called directly, the conversion "
            "views AWQ's K-first int32 words as N-first bytes"
        ),
    ),
    (
        lambda c: c.backend == "XPU" and not c.sym and c.integration != "auto_awq",
        Refused(
            "AssertionError",
            "",
            "the XPU conversion returns no zero points (its experts take symmetric int4 "
            "only), and compressed-tensors and MoeWNA16 assert they got them",
        ),
    ),
    (
        lambda c: c.backend == "XPU" and c.integration == "auto_awq" and not c.sym,
        Wrong(
            "the XPU conversion returns no zero points (its experts take symmetric int4 only: "
            "the oracle never picks XPU for them); AutoAWQ loads without them"
        ),
    ),
    (
        lambda c: c.backend == "XPU" and c.integration == "auto_awq",
        Exact(),  # the qzeros AutoAWQ leaves uninitialised are not converted for XPU
    ),
    (
        lambda c: c.integration == "auto_awq" and c.sym,
        Wrong(
            "AutoAWQ with zero_point=false still registers qzeros (torch.empty), nothing "
            "loads them, and emulation dequantizes with that uninitialised memory"
        ),
    ),
    (
        lambda c: c.integration == "compressed_tensors" and _act(c),
        Wrong(
            "0.33's compressed-tensors MoE registers no weight_g_idx parameter: act-order "
            "is dropped silently, so vLLM's output is the layer without its g_idx",
            drops_g_idx=True,
        ),
    ),
    (lambda c: True, Exact()),
)


def holds_uninitialised_memory(case: Case) -> bool:
    """vLLM's layer holds memory nothing wrote: AutoAWQ without zero points registers
    `qzeros` with `torch.empty` and nothing loads them. A record keeps only those
    parameters' dtypes and shapes (`UNINITIALISED_PARAMS`)."""
    return case.integration == "auto_awq" and case.sym


#: The parameters `holds_uninitialised_memory` means, as a record names them.
UNINITIALISED_PARAMS = ("param.w13_qzeros", "param.w2_qzeros")


def reads_uninitialised_memory(case: Case) -> bool:
    """vLLM's outputs for the case depend on that memory (every conversion but XPU's, which
    drops zero points, reads the qzeros). A record keeps only dtypes and shapes for them."""
    return holds_uninitialised_memory(case) and case.backend != "XPU"


# Rules of older releases, each read from that release's source; the releases that have
# each one are composed below, the older rules first.
MARLIN_ACT_ORDER_SORTED: Rule = (
    lambda c: c.backend == "MARLIN" and _act(c) and (c.sym or c.integration != "auto_gptq"),
    Exact(),  # our writer's sorted act-order form, for a ruleset that accepts act-order
)
GPTQ_ACT_ORDER_ACCEPTED: Rule = (
    lambda c: c.integration in GPTQ_INTEGRATION and _act(c),
    DropsActOrder(
        "up to 0.29 GPTQ act-order (desc_act) loads, but the TRITON, EMULATION and XPU "
        "conversions ignore g_idx (they return no g_idx or sort indices)"
    ),
)
CT_ACT_ORDER_ASSERT: Rule = (
    lambda c: c.integration == "compressed_tensors" and _act(c) and _off_marlin(c),
    Refused(
        "AssertionError",
        "",
        "up to 0.29 compressed-tensors accepts actorder=group at parse, and its non-Marlin "
        "path asserts actorder != 'group'",
    ),
)
MOE_WNA16_EMULATION_SYMMETRIC: Rule = (
    lambda c: (
        c.integration.startswith("moe_wna16")
        and c.backend == "EMULATION"
        and c.sym
        and c.group_size != -1
        and (c.integration == "moe_wna16/gptq" or c.bits == 4)  # AWQ asserts 4-bit first
        and not (c.integration in GPTQ_INTEGRATION and _act(c))  # act-order refused first
    ),
    Refused(
        "RuntimeError",
        "The size of tensor a",
        "up to 0.30 the emulation conversion reads MoeWNA16's uint8 bytes as int32 GPTQ "
        "words and the shapes do not broadcast",
    ),
)
CT_TRITON_ONE_GROUP_ZERO_POINTS: Rule = (
    lambda c: (
        c.integration == "compressed_tensors"
        and c.backend == "TRITON"
        and not c.sym
        and c.group_size != -1
        and _one_group(c)
    ),
    Refused(
        "RuntimeError",
        "to view Int as Byte",
        "up to 0.30 the TRITON zero-point repack views a [E, N/pf, 1] transpose as bytes, as "
        "0.33 still does for AutoGPTQ",
    ),
)
MOE_WNA16_INT8_ZERO_POINTS: Rule = (
    lambda c: (
        c.integration == "moe_wna16/gptq"
        and c.bits == 8
        and not c.sym
        and c.group_size != -1
        and not _act(c)
    ),
    Refused(
        "RuntimeError",
        "The expanded size of the tensor",
        "up to 0.31 MoeWNA16's loader writes each 8-bit w13 zero-point shard into "
        "[:shard_size // 2] / [shard_size // 2:] (0.32 divides by the 8-bit pack factor): "
        "the shard does not fit and loading fails",
    ),
)

QUARK_NO_W4A16_METHOD: Rule = (
    _QUARK,
    Refused(
        "RuntimeError",
        "Unsupported FusedMoe scheme",
        "up to 0.30 Quark has no int4 weight-only MoE method: its config refuses the layer",
    ),
)

_UP_TO_0_31: tuple[Rule, ...] = (MOE_WNA16_INT8_ZERO_POINTS,)
_UP_TO_0_30: tuple[Rule, ...] = (
    QUARK_NO_W4A16_METHOD,
    MOE_WNA16_EMULATION_SYMMETRIC,
    CT_TRITON_ONE_GROUP_ZERO_POINTS,
    *_UP_TO_0_31,
)
_UP_TO_0_29: tuple[Rule, ...] = (
    MARLIN_ACT_ORDER_SORTED,
    GPTQ_ACT_ORDER_ACCEPTED,
    CT_ACT_ORDER_ASSERT,
    *_UP_TO_0_30,
)
GPTQ_TRITON_ZEROS_PASSED_THROUGH: Rule = (
    lambda c: c.integration == "auto_gptq" and c.backend == "TRITON" and c.sym and not _act(c),
    Exact(("sym-zeros-k-first",)),
)
CT_NON_MARLIN_SYMMETRIC_ONLY: Rule = (
    lambda c: (
        c.integration == "compressed_tensors"
        and not c.sym
        and c.group_size != -1
        and _off_marlin(c)
    ),
    Refused(
        "AssertionError",
        "Only symmetric quantization is supported for MoE",
        "up to 0.28 compressed-tensors' non-Marlin MoE path asserts symmetric weights",
    ),
)
CT_INT8_CHANNELWISE_ONLY: Rule = (
    lambda c: c.integration == "compressed_tensors" and c.bits == 8 and c.group_size != -1,
    Refused(
        "AssertionError",
        "",
        "up to 0.28 compressed-tensors' 8-bit MoE asserts group_size == -1",
    ),
)
MOE_WNA16_INT8_CHANNELWISE_ONLY: Rule = (
    lambda c: c.integration.startswith("moe_wna16") and c.bits == 8 and c.group_size != -1,
    Refused("AssertionError", "", "up to 0.28 MoeWNA16's 8-bit method asserts group_size == -1"),
)
# compressed-tensors' __init__ asserts in this order: 8-bit channelwise, act-order, symmetry.
_UP_TO_0_28: tuple[Rule, ...] = (
    GPTQ_TRITON_ZEROS_PASSED_THROUGH,
    CT_INT8_CHANNELWISE_ONLY,
    CT_ACT_ORDER_ASSERT,
    CT_NON_MARLIN_SYMMETRIC_ONLY,
    MOE_WNA16_INT8_CHANNELWISE_ONLY,
    *_UP_TO_0_29,
)

#: Per release older than 0.33, the rules where its conversions differ from 0.33's, checked
#: before 0.33's (first match wins), each read from that release's source and proven by its
#: conversion record (`test_conversion_records.py`).
RELEASE_RULES: dict[str, tuple[Rule, ...]] = {
    "vllm-0.31": _UP_TO_0_31,
    "vllm-0.30": _UP_TO_0_30,
    "vllm-0.29": _UP_TO_0_29,
    "vllm-0.28": _UP_TO_0_28,
    "vllm-0.27": _UP_TO_0_28,
}

#: Per release, departures its conversions add to an exact case's (a predicate and the
#: departure's name): compressed-tensors registers no expert bias up to 0.30.
RELEASE_DEPARTURES: dict[str, tuple[tuple[Callable[[Case], bool], str], ...]] = {
    ruleset: ((lambda c: c.integration == "compressed_tensors" and c.bias, "ct-bias-not-loaded"),)
    for ruleset in ("vllm-0.30", "vllm-0.29", "vllm-0.28", "vllm-0.27")
}


def expectation(case: Case, ruleset: str = "vllm-0.33") -> Expectation:
    """What `ruleset`'s vLLM release does with the case (0.33's rules where it has none)."""
    for predicate, outcome in (*RELEASE_RULES.get(ruleset, ()), *RULES):
        if not predicate(case):
            continue
        if isinstance(outcome, DropsActOrder):
            inner = expectation(replace(case, act=False), ruleset)
            return Wrong(outcome.why, drops_g_idx=True) if isinstance(inner, Exact) else inner
        if isinstance(outcome, Exact):
            added = [name for test, name in RELEASE_DEPARTURES.get(ruleset, ()) if test(case)]
            return Exact((*departures(case), *outcome.departures, *added))
        return outcome
    raise AssertionError("the last rule matches everything")


def departures(case: Case) -> tuple[str, ...]:
    """Where our correct output differs from vLLM's, on purpose, for a case vLLM converts."""
    out = []
    if case.backend == "EMULATION":
        if case.integration == "auto_gptq":
            out.append("gptq-v1-zero")  # vLLM subtracts the stored zero-1 (R2)
        if case.scale_dtype != "bfloat16":
            out.append("scale-rounding")  # vLLM rounds the scale to bf16 first
        if case.bias:
            out.append("bias-dropped")  # vLLM returns no bias (R7)
    elif case.sym and case.integration == "auto_gptq" and case.backend != "XPU":
        out.append("sym-zeros-unused")  # vLLM converts the stored midpoint; kernel ignores it
    if case.backend == "MARLIN" and case.group_size == INTER < H:
        # vLLM picks w13's scale order by size_k = I: one group there, but H / group here
        out.append("marlin-scale-order")
    if case.bias and case.integration == "auto_awq":
        out.append("awq-bias-not-loaded")  # no bias parameter, load_weights skips it
    return tuple(out)
