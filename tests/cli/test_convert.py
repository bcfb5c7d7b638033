"""`moe-control convert` locally: whole checkpoints (with resume) and single layers."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.cli import main
from service.formats import registry
from service.formats.checkpoint.plan import MANIFEST_NAME
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.writers import ConversionOptions

SPEC = SyntheticSpec(num_layers=2, num_experts=4, hidden_size=128, intermediate_size=128)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    directory = tmp_path_factory.mktemp("cli") / "mixtral"
    return directory, write_synthetic_checkpoint(directory, SPEC)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    status = main(["convert", *argv, "--json", "--no-progress"])
    out = capsys.readouterr().out.strip()
    return status, json.loads(out.splitlines()[-1]) if out else {}


def test_whole_checkpoint_then_instant_resume(
    model: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, _ = model
    out = tmp_path / "triton"
    status, first = run_json(capsys, str(source), str(out), "--backend", "triton")
    assert status == 0
    assert (first["layers_converted"], first["layers_skipped"]) == (2, 0)
    assert first["backend"] == "TRITON" and first["backend_chosen_by"] == "request"
    assert Path(first["manifest_path"]) == out / MANIFEST_NAME
    status, second = run_json(
        capsys, "--input", str(source), "--output", str(out), "--backend", "TRITON"
    )
    assert status == 0
    assert (second["layers_converted"], second["layers_skipped"]) == (0, 2)


def test_auto_takes_the_platform_choice(
    model: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, _ = model
    status = main(["convert", str(source), str(tmp_path / "a100"), "--platform", "a100"])
    captured = capsys.readouterr()
    supported = "MARLIN" in registry.TARGET_BACKENDS
    assert status == (0 if supported else 1), captured.err
    if not supported:
        assert "MARLIN" in captured.err and "--backend" in captured.err


def test_progress_lines_on_a_pipe(
    model: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, _ = model
    assert (
        main(["convert", str(source), str(tmp_path / "p"), "--backend", "TRITON", "--progress"])
        == 0
    )
    err = capsys.readouterr().err
    # Two layers are written at once, so either may finish first; each is counted and
    # reported in one step, so the lines count 1/2 then 2/2, one line per layer.
    converted = re.findall(r"converted (moe-layer-\d+\.safetensors) \((\d+)/2 layers", err)
    assert sorted(name for name, _ in converted) == [
        "moe-layer-00000.safetensors",
        "moe-layer-00001.safetensors",
    ], err
    assert [int(count) for _, count in converted] == [1, 2], err


def test_one_layer_file(
    model: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, layers = model
    shard = next(iter(sorted(source.glob("model-*.safetensors"))))
    out = tmp_path / "layer0.safetensors"
    status, summary = run_json(
        capsys,
        str(shard),
        str(out),
        "--backend",
        "TRITON",
        "--layer",
        "0",
        "--config",
        str(source / "config.json"),
    )
    assert status == 0, summary
    written = load_file(out)
    expected = registry.convert(layers[0], "TRITON", source="gptq").tensors
    module = "model.layers.0.block_sparse_moe.experts"
    assert set(written) == {f"{module}.{name}" for name in expected}
    for name, tensor in expected.items():
        assert torch.equal(written[f"{module}.{name}"], tensor)
    assert [t["name"] for t in summary["tensors"]] == list(written)


def test_act_order_checkpoint_on_marlin_follows_the_ruleset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under a ruleset whose release accepts act-order, a whole GPTQ act-order checkpoint
    converts to that release's sorted Marlin form (the manifest records the ruleset); under
    0.33 it is refused with the reason."""
    source = tmp_path / "act"
    layers = write_synthetic_checkpoint(source, dataclasses.replace(SPEC, desc_act=True))
    out = tmp_path / "marlin-0.29"
    argv = ["--backend", "MARLIN", "--ruleset", "vllm-0.29"]
    status, summary = run_json(capsys, str(source), str(out), *argv)
    assert status == 0, summary
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["ruleset"] == "vllm-0.29"
    options = ConversionOptions(ruleset="vllm-0.29")
    expected = registry.convert(layers[1], "MARLIN", source="gptq", options=options).tensors
    written = load_file(out / "moe-layer-00001.safetensors")
    module = "model.layers.1.block_sparse_moe.experts"
    assert set(written) == {f"{module}.{name}" for name in expected}
    assert "w13_g_idx_sort_indices" in expected
    for name, tensor in expected.items():
        assert torch.equal(written[f"{module}.{name}"], tensor), name
    refused = main(["convert", str(source), str(tmp_path / "marlin-0.33"), "--backend", "MARLIN"])
    assert refused == 1
    assert "act-order" in capsys.readouterr().err
    assert not (tmp_path / "marlin-0.33").exists(), "a refused conversion left its directory"


FAILURES = {
    "no writer": (["--backend", "CPU"], 1, "cannot write CPU"),
    "unknown backend": (["--backend", "WARP"], 2, "unknown backend"),
    "bad range": (["--layers", "x:y", "--backend", "TRITON"], 2, "--layers"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_failures_exit_with_a_reason(
    model: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    source, _ = model
    argv, code, message = FAILURES[case]
    assert main(["convert", str(source), str(tmp_path / "o"), *argv]) == code
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("inside", [".", "converted", "a/b"])
def test_an_output_inside_the_input_is_refused(
    model: tuple[Path, Any], capsys: pytest.CaptureFixture[str], inside: str
) -> None:
    source, _ = model
    before = sorted(p.name for p in source.iterdir())
    assert main(["convert", str(source), str(source / inside), "--backend", "TRITON"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.output_dir" in err and "inside the input directory" in err
    assert sorted(p.name for p in source.iterdir()) == before


def test_input_given_twice_or_not_at_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "a", "b", "--input", "c"]) == 2
    assert main(["convert"]) == 2
    assert "INPUT" in capsys.readouterr().err
