"""Which experts each token goes to: vLLM's default top-k routing, or ids and weights given.

vLLM's default router (`FusedTopKRouter` -> `fused_topk`, CUDA `topk_softmax` /
`topk_sigmoid`) scores every expert in float32 (softmax over the experts, or an
element-wise sigmoid), keeps the k best in descending order (ties go to the lower expert
id), and with `renormalize` divides the kept scores by their sum. The result is float32
weights and int32 ids, [M, k]. This module does the same in torch, on any device, without a
host synchronisation, so it can sit inside a CUDA graph, and in few kernel launches: at M = 1
each launch is most of the cost (on the H200 host ~0.03-0.04 ms of Python and driver time
per op, bench/RESULTS.md), so renormalizing is one clamp and one division rather than five
ops.
"""

from __future__ import annotations

import torch

from service.kernels.errors import KernelInputError

SCORING_FUNCS = ("softmax", "sigmoid")

#: The smallest positive float32 (subnormal): a sum clamped to it is itself whenever it is
#: positive, and 0 / it is 0, so `w / sum.clamp_min(TINY)` is `w / (sum if sum > 0 else 1)`
#: for every sum routing can give (>= 0, or NaN, which stays NaN either way).
TINY = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23


def topk_route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, k], topk_ids int32 [M, k]) from router logits [M, E]."""
    if router_logits.dim() != 2:
        raise KernelInputError(
            "router_logits", f"must be 2-D [M, E], got shape {list(router_logits.shape)}"
        )
    if not router_logits.dtype.is_floating_point:
        raise KernelInputError(
            "router_logits", f"must be a float tensor, not {router_logits.dtype}"
        )
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise KernelInputError("top_k", f"must be 1..{num_experts}, got {top_k}")
    logits = router_logits.to(torch.float32)
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise KernelInputError(
            "scoring_func", f"{scoring_func!r} is not one of {list(SCORING_FUNCS)}"
        )
    # A stable descending sort keeps the lower expert id first among equal scores, as the
    # CUDA kernels do (torch.topk leaves tie order unspecified).
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    weights, ids = values[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(TINY)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def given_route(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Caller-given routing, checked and brought to the kernels' dtypes (float32, int32)."""
    check_given_route(topk_ids, topk_weights, num_experts)
    return as_route(topk_ids, topk_weights)


def check_given_route(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    """Reject caller-given routing that the kernels cannot take.

    Ids outside [0, num_experts) are rejected here, which reads them (a synchronisation on a
    GPU: the worker checks the host copy it received instead, then converts the device copy
    with `as_route`): given routing comes from outside, so it is always checked.
    """
    if topk_ids.dim() != 2:
        raise KernelInputError("topk_ids", f"must be 2-D [M, k], got {list(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise KernelInputError("topk_ids", f"must be an integer tensor, not {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise KernelInputError(
            "topk_weights",
            f"shape {list(topk_weights.shape)} differs from topk_ids {list(topk_ids.shape)}",
        )
    if not topk_weights.dtype.is_floating_point:
        raise KernelInputError("topk_weights", f"must be a float tensor, not {topk_weights.dtype}")
    if not 1 <= topk_ids.shape[1] <= num_experts:
        raise KernelInputError("topk_ids", f"top-k must be 1..{num_experts}")
    if topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts:
            raise KernelInputError(
                "topk_ids", f"expert ids must be in [0, {num_experts}), got [{low}, {high}]"
            )


def as_route(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked routing (`check_given_route`) in the kernels' dtypes: (float32, int32)."""
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()
