"""vLLM's default top-k routing against a per-token Python reference; given routing checks."""

from __future__ import annotations

import math

import pytest
import torch

from service.kernels.errors import KernelInputError
from service.kernels.routing import TINY, as_route, check_given_route, given_route, topk_route


def _reference(logits: torch.Tensor, k: int, renormalize: bool, scoring: str):
    weights, ids = [], []
    for row in logits.double().tolist():
        if scoring == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        best = sorted(range(len(row)), key=lambda e: (-scores[e], e))[:k]
        chosen = [scores[e] for e in best]
        if renormalize:
            chosen = [v / sum(chosen) for v in chosen]
        weights.append(chosen)
        ids.append(best)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("m", "e", "k"), [(1, 8, 2), (7, 60, 4), (33, 128, 8), (5, 4, 4)])
def test_matches_reference(scoring: str, renormalize: bool, m: int, e: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * e + k)
    logits = torch.randn(m, e, generator=gen).to(torch.bfloat16)
    weights, ids = topk_route(logits, k, renormalize=renormalize, scoring_func=scoring)
    want_w, want_ids = _reference(logits, k, renormalize, scoring)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (m, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    _, ids = topk_route(logits, 2)
    assert ids.tolist() == [[1, 2]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"router_logits": torch.zeros(4), "top_k": 1}, "router_logits"),
        ({"router_logits": torch.zeros(2, 4, dtype=torch.int32), "top_k": 1}, "router_logits"),
        ({"router_logits": torch.zeros(2, 4), "top_k": 5}, "top_k"),
        ({"router_logits": torch.zeros(2, 4), "top_k": 1, "scoring_func": "tanh"}, "scoring_func"),
    ],
)
def test_bad_logits(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(KernelInputError) as info:
        topk_route(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_given_route_normalises_dtypes() -> None:
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int64)
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float16)
    w, i = given_route(ids, weights, 4)
    assert i.dtype == torch.int32 and w.dtype == torch.float32
    assert i.tolist() == ids.tolist()


@pytest.mark.parametrize(
    ("ids", "weights", "field"),
    [
        (torch.tensor([[0, 4]]), torch.ones(1, 2), "topk_ids"),
        (torch.tensor([[-1, 2]]), torch.ones(1, 2), "topk_ids"),
        (torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), "topk_ids"),
        (torch.tensor([[0, 1]]), torch.ones(1, 3), "topk_weights"),
        (torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.int32), "topk_weights"),
        (torch.tensor([0, 1]), torch.ones(2), "topk_ids"),
    ],
)
def test_given_route_rejects(ids: torch.Tensor, weights: torch.Tensor, field: str) -> None:
    with pytest.raises(KernelInputError) as info:
        given_route(ids, weights, 4)
    assert info.value.field == field


def test_renormalizing_a_zero_sum_leaves_zeros_and_nan_stays_nan() -> None:
    """`w / sum.clamp_min(TINY)` is `w / (sum if sum > 0 else 1)`: sigmoid scores that are
    all 0 stay 0 (no 0 / 0), tiny positive sums still normalise to 1, NaN stays NaN."""
    logits = torch.tensor(
        [[-200.0, -300.0, -400.0], [-80.0, -81.0, -82.0], [float("nan"), 0.0, 1.0]]
    )
    weights, ids = topk_route(logits, 2, scoring_func="sigmoid")
    scores = torch.sigmoid(logits)
    assert weights[0].tolist() == [0.0, 0.0] and ids[0].tolist() == [0, 1]
    top = scores[1, :2]
    assert torch.allclose(weights[1], top / top.sum(), rtol=1e-6)
    assert float(weights[1].sum()) == pytest.approx(1.0, rel=1e-6)
    assert torch.isnan(weights[2]).any()
    assert TINY > 0.0 and torch.tensor(TINY).item() == TINY  # representable, not flushed


def test_checking_and_converting_given_routing_apart() -> None:
    """The worker checks the host copy (`check_given_route`, which reads the ids) and
    converts the device copy (`as_route`, which reads nothing): together, `given_route`."""
    ids = torch.tensor([[3, 0]], dtype=torch.int16)
    weights = torch.tensor([[0.75, 0.25]], dtype=torch.bfloat16)
    check_given_route(ids, weights, 4)
    w, i = as_route(ids, weights)
    gw, gi = given_route(ids, weights, 4)
    assert torch.equal(w, gw) and torch.equal(i, gi) and i.dtype == torch.int32
    with pytest.raises(KernelInputError) as info:
        check_given_route(ids, weights, 3)
    assert info.value.field == "topk_ids"
