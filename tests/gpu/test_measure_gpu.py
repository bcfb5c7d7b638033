"""The worker's measure_backends job on a GPU (SelectBackend's MEASURED policy).

Marked `gpu` and skipped without CUDA; `make gpu-test` runs it on the H200. Every backend the
worker runs is timed on a small layer, each at two token counts, through a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from service.ipc import codec
from service.ipc.messages import MeasureBackends
from service.worker.jobs import JobContext
from service.worker.main import Worker
from service.worker.measure import measure_backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_every_backend_is_timed_on_the_gpu() -> None:
    worker = Worker("cuda:0")
    answer = measure_backends(
        worker,
        codec.from_json(
            MeasureBackends,
            {
                "shape": {
                    "num_experts": 8,
                    "top_k": 2,
                    "hidden_size": 512,
                    "intermediate_size": 256,
                },
                "source": {"layout": "gptq", "bits": 4, "group_size": 128, "symmetric": True},
                "backends": ["HUMMING", "MARLIN", "BATCHED_MARLIN", "TRITON", "EMULATION"],
                "token_counts": [1, 64],
                "budget_s": 0.05,
            },
        ),
        JobContext(1, lambda line: None),
    )
    assert answer.device_name == torch.cuda.get_device_name(0)
    by = {r.backend: r for r in answer.results}
    for name in ("TRITON", "EMULATION"):
        assert set(by[name].seconds) == {"1", "64"}, by[name]
    for name in ("HUMMING", "MARLIN", "BATCHED_MARLIN"):  # present where .gpu/ was carried
        result = by[name]
        assert set(result.seconds) == {"1", "64"} or "unavailable" in result.error, result
    for result in by.values():
        assert all(0 < s < 1.0 for s in result.seconds.values()), result
