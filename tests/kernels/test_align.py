"""Block alignment (vLLM's moe_align_block_size semantics) against a Python loop reference."""

from __future__ import annotations

import pytest
import torch

from service.kernels.align import Alignment, align_block_size, max_padded_size
from service.kernels.errors import KernelInputError
from tests.kernels.helpers import KERNEL_DEVICE


def _reference(ids: torch.Tensor, bs: int, e: int) -> tuple[list[int], list[int], int]:
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for expert in range(e):
        routes = [r for r, x in enumerate(flat) if x == expert]
        if not routes:
            continue
        padded = -(-len(routes) // bs) * bs
        sorted_ids += routes + [n] * (padded - len(routes))
        expert_ids += [expert] * (padded // bs)
    total = len(sorted_ids)
    size = max_padded_size(n, e, bs)
    blocks = -(-size // bs)
    return sorted_ids + [n] * (size - total), expert_ids + [-1] * (blocks - len(expert_ids)), total


def _align(ids: torch.Tensor, bs: int, e: int, impl: str) -> Alignment:
    """Triton runs where the kernels run (GPU, or CPU interpreted); results come back to CPU."""
    device = KERNEL_DEVICE if impl == "triton" else torch.device("cpu")
    got = align_block_size(ids.to(device), bs, e, impl=impl)
    return Alignment(
        got.sorted_ids.cpu(),
        got.expert_ids.cpu(),
        got.num_tokens_post_padded.cpu(),
        got.block_size,
        got.num_routes,
    )


def _routing(m: int, e: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)


CASES = [
    (1, 8, 2, 16),  # fewer routes than experts' worth of padding
    (1, 128, 8, 16),  # Qwen3 decode: fewer routes than experts
    (5, 8, 2, 4),
    (37, 60, 4, 16),
    (16, 128, 8, 64),
    (200, 16, 2, 32),
    (80, 256, 8, 16),  # 640 routes: still one program
    (150, 256, 8, 16),  # 1200 routes: the three-kernel Triton path, a partial last chunk
    (300, 128, 8, 32),  # 2400 routes: three-kernel path, many chunks
    (600, 8, 2, 128),  # few experts, many routes each
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(("m", "e", "k", "bs"), CASES)
def test_matches_reference(impl: str, m: int, e: int, k: int, bs: int) -> None:
    ids = _routing(m, e, k, seed=m + e)
    got = _align(ids, bs, e, impl)
    sorted_ids, expert_ids, total = _reference(ids, bs, e)
    assert got.sorted_ids.tolist() == sorted_ids
    assert got.expert_ids.tolist() == expert_ids
    assert got.num_tokens_post_padded.tolist() == [total]
    assert got.sorted_ids.dtype == got.expert_ids.dtype == torch.int32


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_vllm_docstring_example(impl: str) -> None:
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    got = _align(ids, 4, 5, impl)
    want = [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert got.sorted_ids.tolist()[:16] == want
    assert got.expert_ids.tolist()[:4] == [1, 2, 3, 4]
    assert got.num_tokens_post_padded.item() == 16


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_out_of_range_ids_are_skipped(impl: str) -> None:
    ids = torch.tensor([[0, 9], [-1, 1], [1, 0]], dtype=torch.int32)
    got = _align(ids, 2, 4, impl)
    assert got.sorted_ids.tolist()[:4] == [0, 5, 3, 4]
    assert got.num_tokens_post_padded.item() == 4
    # The same on the three-kernel path: out-of-range ids take no slot.
    many = _routing(700, 8, 2, seed=1)
    many[::7, 0] = 8
    many[::5, 1] = -3
    got = _align(many, 16, 8, impl)
    valid = many.clone()
    valid[(many < 0) | (many >= 8)] = 99
    sorted_ids, expert_ids, total = _reference(valid, 16, 8)
    assert got.sorted_ids.tolist() == sorted_ids[: got.sorted_ids.numel()]
    assert got.expert_ids.tolist()[: len(expert_ids)] == expert_ids[: got.expert_ids.numel()]
    assert got.num_tokens_post_padded.item() == total


def test_bad_arguments() -> None:
    with pytest.raises(KernelInputError):
        align_block_size(torch.zeros(4, dtype=torch.int32), 16, 8)
    with pytest.raises(KernelInputError):
        align_block_size(torch.zeros(1, 2, dtype=torch.float32), 16, 8)
    with pytest.raises(KernelInputError):
        align_block_size(torch.zeros(1, 2, dtype=torch.int32), 16, 8, impl="cuda")
