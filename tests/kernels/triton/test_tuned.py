"""The tuned tables: shipped as JSON, read by device name and layer shape, token counts
bucketed, K tiles refitted to the layer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from service.kernels.interface import LayerSpec
from service.kernels.triton import tuned
from service.kernels.triton.config import PREFILL, PREFILL_RS, GemmTile, KernelConfig
from service.kernels.triton.tuned import config_from_dict, config_key, config_to_dict, tuned_config


def test_tuned_tables_round_trip_and_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = LayerSpec(128, 2048, 768, 4, 128)
    small = KernelConfig(16, GemmTile(32, 256, 4, 4), GemmTile(64, 128, split_k=2))
    large = replace(small, block_m=128, w2=GemmTile(64, 128))
    assert config_from_dict(json.loads(json.dumps(config_to_dict(small)))) == small
    table = {
        "device": "Test GPU",
        "configs": {
            config_key(spec, 8): {"1": config_to_dict(small), "256": config_to_dict(large)}
        },
    }
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tuned._tuned_tables.cache_clear()
    try:
        (tmp_path / "Test_GPU.json").write_text(json.dumps(table))
        assert tuned_config("Test GPU", spec, 1, 8) == small
        assert tuned_config("Test GPU", spec, 2, 8) == large  # smallest tuned count >= M
        assert tuned_config("Test GPU", spec, 9000, 8) == large  # past the last: the last
        assert tuned_config("Test GPU", spec, 1, 4) is None  # another top-k: not tuned
        assert tuned_config("Other GPU", spec, 1, 8) is None
        # K tiles are refitted to the layer (256 does not divide H=1408).
        g64 = LayerSpec(128, 1408, 768, 4, 64)
        table["configs"] = {config_key(g64, 8): {"1": config_to_dict(small)}}
        (tmp_path / "Test_GPU.json").write_text(json.dumps(table))
        tuned._tuned_tables.cache_clear()
        fitted = tuned_config("Test GPU", g64, 1, 8)
        assert fitted is not None and fitted.w13.block_k == 128
    finally:
        tuned._tuned_tables.cache_clear()


def test_a_table_from_another_tuner_is_refused() -> None:
    """Unknown keys are an error: a table written for other kernels must not be half-read."""
    data = config_to_dict(KernelConfig(16, GemmTile(32, 128), GemmTile(64, 128)))
    with pytest.raises(TypeError):
        config_from_dict({**data, "fused_routes": True})


def test_shipped_tables_parse() -> None:
    """Every JSON shipped in the package loads into valid prefill configurations (either
    prefill generation: the register-operand kernels where they measured faster), and every
    layer in it has a row for M=1 (tuned_config takes the smallest row >= M: without one,
    small batches would run a larger bucket's tiles)."""
    paths = sorted(tuned.CONFIG_DIR.glob("*.json"))
    assert paths
    for path in paths:
        data = json.loads(path.read_text())
        for rows in data["configs"].values():
            assert "1" in rows
            for cfg in rows.values():
                config = config_from_dict(cfg)
                assert config.kernel in (PREFILL, PREFILL_RS)
                assert config.block_m in (16, 32, 64, 128, 256)
