"""vLLM's default top-k routing against a per-token Python reference; given routing checks."""

from __future__ import annotations

import math

import pytest
import torch

from service.kernels.errors import KernelInputError
from service.kernels.routing import given_route, topk_route


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
