"""`select --config` sources: a config.json, a model directory, a directory of configs, and
a Hugging Face repo id read through huggingface_hub from a cache built here in the
library's own layout, offline (no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli.configs import load_model_configs
from service.oracle import InvalidSpecError

REPO_ID = "Qwen/Qwen3-30B-A3B-GPTQ-Int4"
REVISION = "0a1b2c3d4e5f60718293a4b5c6d7e8f901234567"
QWEN3_30B_GPTQ = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
}
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_file_is_labelled_by_its_model_directory_or_stem(tmp_path: Path) -> None:
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(QWEN3_30B_GPTQ))
    (tmp_path / "mixtral.json").write_text("{}")
    models = load_model_configs(
        [str(tmp_path / "qwen3" / "config.json"), str(tmp_path / "mixtral.json")]
    )
    assert [m.label for m in models] == ["qwen3", "mixtral"]
    assert models[0].config == QWEN3_30B_GPTQ
    assert models[0].origin == str(tmp_path / "qwen3" / "config.json")


def test_a_model_directory_is_its_config_json(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3-30B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_GPTQ))
    (model / "generation_config.json").write_text("{}")  # not a second model
    (models,) = [load_model_configs([str(model)])]
    assert [m.label for m in models] == ["Qwen3-30B"]


def test_a_directory_of_configs_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text("{}")
    (tmp_path / "a-model").mkdir()
    (tmp_path / "a-model" / "config.json").write_text("{}")
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert [m.label for m in load_model_configs([str(tmp_path)])] == ["a-model", "b"]


def test_bad_sources_name_the_flag(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidSpecError) as bad:
        load_model_configs([str(tmp_path / "bad.json")])
    assert "not JSON" in bad.value.violations[0].description
    (tmp_path / "nothing").mkdir()
    with pytest.raises(InvalidSpecError) as empty:
        load_model_configs([str(tmp_path / "nothing")])
    assert "holds no config.json" in empty.value.violations[0].description
    with pytest.raises(InvalidSpecError) as neither:
        load_model_configs([str(tmp_path / "missing" / "config.json")])
    assert neither.value.violations[0].field == f"--config {tmp_path / 'missing' / 'config.json'}"
    assert "cannot read: no such file" in neither.value.violations[0].description


def hub_cache(root: Path) -> Path:
    """A cache in huggingface_hub's layout: models--Org--Name/{refs/main, snapshots/REV/}."""
    repo = root / ("models--" + REPO_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3_30B_GPTQ))
    return root


def select_offline(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI in a fresh process (huggingface_hub reads its settings at import)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "select", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_a_repo_id_is_read_from_the_hub_cache_offline(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path / "hub")
    done = select_offline(cache, "--config", REPO_ID, "--gpu", "a100,h100", "--json")
    assert done.returncode == 0, done.stderr
    matrix = json.loads(done.stdout)
    assert matrix["models"] == [{"label": REPO_ID, "origin": f"hf://{REPO_ID}"}]
    assert [c["backend"] for c in matrix["cells"]] == ["MARLIN", "HUMMING"]
    pinned = select_offline(cache, "--config", f"{REPO_ID}@{REVISION}", "--gpu", "a100", "--json")
    assert pinned.returncode == 0, pinned.stderr
    assert json.loads(pinned.stdout)["backend"] == "MARLIN"


def test_a_repo_not_in_the_cache_offline_is_invalid_input(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path / "hub")
    done = select_offline(cache, "--config", "Qwen/Not-Cached", "--gpu", "a100", "--json")
    assert done.returncode == 2
    (violation,) = json.loads(done.stderr)["invalid"]
    assert violation["field"] == "--config Qwen/Not-Cached"
    assert "not in the Hugging Face cache" in violation["description"]
