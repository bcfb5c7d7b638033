"""The launch configuration: the prefill heuristic's tiles fit every layer, K tiles below 32
stay off the wrapped tensor-core layout, and the decode choice."""

from __future__ import annotations

import pytest

from service.kernels.errors import KernelUnavailableError
from service.kernels.interface import LayerSpec
from service.kernels.triton.config import KTile, choose_config, fit_block_k, launch_k_tile
from tests.kernels.triton.test_prefill import ODD_K_LAYERS

SHAPES = {
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "Qwen1.5-MoE-A2.7B": (60, 2048, 1408, 4),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "DeepSeek-V3": (256, 7168, 2048, 8),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("bits", "group"), [(4, 128), (4, 32), (8, -1), (8, 64)])
def test_choose_config_fits_every_shape(shape: str, bits: int, group: int) -> None:
    e, h, i, k = SHAPES[shape]
    spec = LayerSpec(e, h, i, bits, group)
    for m in (1, 4, 16, 64, 256, 1024, 4096):
        config = choose_config(m, k, spec, 132)
        for tile, kdim in ((config.w13, h), (config.w2, i)):
            g = kdim if group == -1 else group
            assert kdim % tile.block_k == 0
            assert g % tile.block_k == 0 or tile.block_k % g == 0
            assert 1 <= tile.split_k <= kdim // tile.block_k
        assert config.block_m in (16, 32, 64, 128)


def test_fit_block_k() -> None:
    assert fit_block_k(256, 2048, 128) == 256
    assert fit_block_k(256, 768, 128) == 256
    assert fit_block_k(128, 1408, 128) == 128
    assert fit_block_k(256, 1408, 32) == 128
    assert fit_block_k(64, 48, 16) == 16
    with pytest.raises(KernelUnavailableError):
        fit_block_k(64, 40, 40)


def test_launch_k_tile() -> None:
    """Compiled: tiles below 32 widen to a masked 32 where the groups nest, else keep their
    width and multiply in float32; interpreted: always float32."""
    compiled = {
        (16, 48, 16): KTile(32, False),
        (16, 48, 48): KTile(32, False),  # channelwise: one group spans K
        (16, 16, 16): KTile(32, False),
        (16, 96, 32): KTile(32, False),  # a caller's 16 where 32 divides K
        (16, 96, 48): KTile(16, True),  # 32 straddles the groups of 48
        (64, 2048, 128): KTile(64, False),
        (128, 1408, 32): KTile(128, False),
    }
    for (bk, k, group), tile in compiled.items():
        assert launch_k_tile(bk, k, group, interpreted=False) == tile, (bk, k, group)
        assert launch_k_tile(bk, k, group, interpreted=True).dot_f32


@pytest.mark.parametrize("layer", sorted(ODD_K_LAYERS))
def test_odd_k_layers_never_launch_a_tensor_core_k_tile_below_32(layer: str) -> None:
    h, i, bits, group, _ = ODD_K_LAYERS[layer]
    spec = LayerSpec(8, h, i, bits, group)
    picked_16 = False
    for m in (1, 4, 64, 1024):
        config = choose_config(m, 2, spec, 132)
        for tile, k in ((config.w13, h), (config.w2, i)):
            picked_16 |= tile.block_k == 16
            launched = launch_k_tile(tile.block_k, k, k if group == -1 else group, False)
            assert launched.block_k >= 32 or launched.dot_f32
    assert picked_16  # the heuristic's own choice: what the launcher must correct
