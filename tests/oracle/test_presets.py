"""The GPU presets users asked for: each has its vendor's capability or arch, follows the
packages convention of its device kind, and decides as that GPU generation does."""

from __future__ import annotations

import pytest

from service.oracle import PLATFORM_PRESETS, preset, select
from service.oracle.platform import DEFAULT_CUDA_PACKAGES

QWEN_GPTQ_LAYER = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
    "layer": {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768},
}


@pytest.mark.parametrize(
    ("name", "capability"),
    [
        ("rtx4090", (8, 9)),
        ("rtx3090", (8, 6)),
        ("rtxa6000", (8, 6)),
        ("l40", (8, 9)),
        ("h20", (9, 0)),
    ],
)
def test_nvidia_presets_have_their_capability_and_vllms_cuda_packages(
    name: str, capability: tuple[int, int]
) -> None:
    profile = preset(name)
    assert profile.device == "cuda"
    assert profile.capability == capability
    assert profile.name == name
    # The same convention as every CUDA preset: a stock vLLM install's kernel packages.
    assert profile.packages == DEFAULT_CUDA_PACKAGES == PLATFORM_PRESETS["h200"].packages


def test_mi250x_is_gfx90a_without_cuda_packages() -> None:
    profile = preset("MI250X")
    assert (profile.device, profile.arch, profile.capability) == ("rocm", "gfx90a", (9, 0))
    assert profile.packages == PLATFORM_PRESETS["mi300x"].packages == frozenset()


@pytest.mark.parametrize(
    ("alias", "name"),
    [("4090", "rtx4090"), ("RTX-3090", "rtx3090"), ("a6000", "rtxa6000"), ("mi250", "mi250x")],
)
def test_aliases_users_type(alias: str, name: str) -> None:
    assert preset(alias).name == name


@pytest.mark.parametrize(
    ("gpu", "same_generation_as"),
    [("rtx4090", "l40s"), ("l40", "l40s"), ("rtx3090", "a10"), ("rtxa6000", "a10")],
)
def test_new_presets_decide_like_their_generation(gpu: str, same_generation_as: str) -> None:
    mine = select({**QWEN_GPTQ_LAYER, "platform": gpu}).to_json()
    theirs = select({**QWEN_GPTQ_LAYER, "platform": same_generation_as}).to_json()
    assert mine["backend"] == theirs["backend"]
    assert [c["verdict"] for c in mine["candidates"]] == [
        c["verdict"] for c in theirs["candidates"]
    ]


def test_h20_decides_as_hopper_with_humming() -> None:
    assert select({**QWEN_GPTQ_LAYER, "platform": "h20"}).backend == "HUMMING"
    assert select({**QWEN_GPTQ_LAYER, "platform": "h100"}).backend == "HUMMING"


def test_mi250x_gets_a_rocm_answer() -> None:
    decision = select({**QWEN_GPTQ_LAYER, "platform": "mi250x"})
    assert decision.backend == select({**QWEN_GPTQ_LAYER, "platform": "mi300x"}).backend
    assert decision.to_json()["candidates"]
