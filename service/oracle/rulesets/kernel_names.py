"""The names `KernelConfig` accepts for `moe_backend`, per vLLM release, as data.

`vllm serve --moe-backend X` checks X against these names (its `MoEBackend` literal) before
any quantization code runs; the WNA16 selection later maps only some of them to a backend
(`Ruleset.user_backends`). The lists differ between releases (the release sheet has `rdna3`
refused by KernelConfig up to 0.29), so every release's table carries its own, in the
literal's order.
"""

from __future__ import annotations

#: vLLM 0.33.0's `vllm.config.kernel.MoEBackend`, in declaration order.
MOE_BACKENDS_0_33: tuple[str, ...] = (
    "auto",
    "triton",
    "batched_triton",
    "deep_gemm",
    "deep_gemm_mega_moe",
    "cutlass",
    "flashinfer_trtllm",
    "flashinfer_cutlass",
    "flashinfer_cutedsl",
    "flashinfer_moe_ep_cutedsl",
    "flashinfer_b12x",
    "b12x",
    "flashinfer_moe_ep_mega_deep_gemm",
    "marlin",
    "humming",
    "triton_unfused",
    "aiter",
    "aiter_mega_moe",
    "aiter_triton_mxfp4_bf16",
    "aiter_triton_mxfp4_mxfp4",
    "flydsl",
    "hpc",
    "emulation",
    "rdna3",
)

#: vLLM 0.32.0's `MoEBackend`: 0.33.0's without `aiter_triton_mxfp4_mxfp4`, which 0.33
#: added (no WNA16 backend maps it, but `vllm serve` refuses it and lists the choices).
MOE_BACKENDS_0_32: tuple[str, ...] = tuple(
    name for name in MOE_BACKENDS_0_33 if name != "aiter_triton_mxfp4_mxfp4"
)


def _with_after(names: tuple[str, ...], anchor: str, added: str) -> tuple[str, ...]:
    """`names` with `added` inserted directly after `anchor`."""
    index = names.index(anchor) + 1
    return (*names[:index], added, *names[index:])


#: vLLM 0.31.0's `MoEBackend` (and 0.30.0's, which is the same literal): 0.32.0's without
#: `flashinfer_moe_ep_cutedsl` and `aiter_mega_moe` (0.32 added both), with
#: `flashinfer_moe_ep_mega_cutedsl` (0.32 removed it), after the mega deep-gemm entry.
MOE_BACKENDS_0_31: tuple[str, ...] = _with_after(
    tuple(
        name
        for name in MOE_BACKENDS_0_32
        if name not in ("flashinfer_moe_ep_cutedsl", "aiter_mega_moe")
    ),
    "flashinfer_moe_ep_mega_deep_gemm",
    "flashinfer_moe_ep_mega_cutedsl",
)


#: vLLM 0.29.0's `MoEBackend`: 0.30.0's without `aiter_triton_mxfp4_bf16` and `rdna3` (0.30
#: added both), so `vllm serve --moe-backend rdna3` is refused there.
MOE_BACKENDS_0_29: tuple[str, ...] = tuple(
    name for name in MOE_BACKENDS_0_31 if name not in ("aiter_triton_mxfp4_bf16", "rdna3")
)

#: The names 0.29 added to `MoEBackend`: vLLM 0.28.0's literal lacks them.
ADDED_IN_0_29: frozenset[str] = frozenset(
    {"b12x", "flashinfer_moe_ep_mega_deep_gemm", "flashinfer_moe_ep_mega_cutedsl"}
)
#: vLLM 0.28.0's `MoEBackend` (`vllm/config/kernel.py`), in declaration order; 0.27.0's is
#: the same list.
MOE_BACKENDS_0_28: tuple[str, ...] = tuple(
    name for name in MOE_BACKENDS_0_29 if name not in ADDED_IN_0_29
)
