"""Shared set-up for the formats tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run these small-tensor tests on one intra-op thread, restoring the setting after.

    Their tensors are a few hundred KiB: a thread pool only adds hand-offs, and on a loaded
    2-core CI machine those cost 100x (a 0.05 ms reduction took 7 ms with two threads).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
