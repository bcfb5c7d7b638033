"""Serving a converted checkpoint: vLLM 0.33's layer from it equals vLLM's own from the source.

Each case writes a synthetic source checkpoint (our quantizer and packers), converts it with
the whole-checkpoint job (`moe-control convert`'s path, config.json included), and hands
both directories to `vllm_loader.py` in vLLM's environment, with the plugin importable.
There vLLM builds the MoE layer twice on a faked CUDA platform and loads it as a model's
`load_weights` does (vLLM's `AutoWeightsLoader`, then its model-level
`process_weights_after_loading`): from the source checkpoint with the backend forced (the
repack), and from the converted directory through the plugin's ``moe_control`` method (no
repack). Then, bit for bit:

- every parameter of the converted layer equals vLLM's parameter of that name (dtype, shape,
  bytes), for TRITON and EMULATION as vLLM converts on CPU and for MARLIN against vLLM's
  pure-torch Marlin reference (the conversion tests' `repack_references`);
- vLLM's layer has no parameter the converted one lacks, except source tensors vLLM keeps
  but no kernel reads (`SOURCE_LEFTOVERS`, each with its reason);
- both layers run the same method class and backend, and a linear layer gets the same
  method from both configs (the source's);
- a converted tensor with one byte changed is refused, naming the tensor; so is a manifest
  changed after the conversion, a ``--moe-backend`` other than the converted one, and a
  layout vLLM cannot be told to select (BATCHED_MARLIN).

The cases are the ones where our writers and vLLM agree exactly (no departure in
`tests/formats/exactness_cases.py` or the Marlin parity cases): EMULATION with bf16 scales,
GPTQ symmetric only (vLLM 0.33's AutoGPTQ takes no other). Skipped when no vLLM 0.33.0
environment exists (`make test` builds `.venv-vllm`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from service.formats.checkpoint.job import convert_checkpoint
from service.formats.checkpoint.plan import MANIFEST_NAME, plan_job
from service.formats.io.paths import DataRoot
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.oracle import preset

pytestmark = pytest.mark.parity

ROOT = Path(__file__).resolve().parents[3]
LOADER = Path(__file__).resolve().with_name("vllm_loader.py")
MODULE = "model.layers.0.block_sparse_moe.experts"

#: Parameters vLLM's source layer keeps that no kernel reads, by integration, and why.
SOURCE_LEFTOVERS = {
    "compressed-tensors": {
        "w13_weight_shape": "the checkpoint's weight_shape, loaded and never converted",
        "w2_weight_shape": "the checkpoint's weight_shape, loaded and never converted",
    },
    "gptq": {
        "w13_qzeros": "symmetric GPTQ's stored midpoints, converted; the kernel subtracts its own",
        "w2_qzeros": "symmetric GPTQ's stored midpoints, converted; the kernel subtracts its own",
    },
    "awq": {},
}


@dataclass(frozen=True)
class Case:
    layout: str
    backend: str
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    dtype: torch.dtype = torch.float16

    @property
    def id(self) -> str:
        sym = "sym" if self.symmetric else "asym"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.layout}-{self.backend}-int{self.bits}-g{self.group_size}-{sym}-{dtype}"

    def spec(self) -> SyntheticSpec:
        return SyntheticSpec(
            layout=self.layout,
            num_layers=1,
            num_experts=4,
            hidden_size=256,
            intermediate_size=256,
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            shards=1,
            dtype=self.dtype,
        )


CASES = (
    Case("compressed-tensors", "TRITON"),
    Case("compressed-tensors", "TRITON", group_size=64, symmetric=False),
    Case("compressed-tensors", "EMULATION", dtype=torch.bfloat16),
    Case("compressed-tensors", "MARLIN"),
    Case("gptq", "MARLIN"),
    Case("awq", "MARLIN", symmetric=False),
)
CORRUPTED = "corrupted-tensor"
CHANGED_MANIFEST = "changed-manifest"
OTHER_MOE_BACKEND = "other-moe-backend"
BATCHED = "batched-marlin"
SHAPES_ONLY = "shapes-only"
TENSOR_PARALLEL = "tensor-parallel"
BAD_VERIFY = "bad-verify-setting"


def _vllm_python() -> Path:
    configured = os.environ.get("MOE_CONTROL_VLLM_PYTHON")
    if configured:
        path = Path(configured)
        assert path.exists(), f"MOE_CONTROL_VLLM_PYTHON={configured} does not exist"
        return path
    default = ROOT / ".venv-vllm" / "bin" / "python"
    if not default.exists():
        pytest.skip("vLLM 0.33.0 reference environment not built (run `make test`)")
    return default


def _convert(root: Path, source: str, output: str, backend: str) -> Path:
    job = plan_job(source, output, root=DataRoot.at(root), platform=preset("h100"), backend=backend)
    result = convert_checkpoint(job)
    assert result.manifest_path is not None
    return root / output


def _entry(case_id: str, case: Case, source: Path, converted: Path, **extra: Any) -> dict:
    spec = case.spec()
    return {
        "id": case_id,
        "source_dir": str(source),
        "converted_dir": str(converted),
        "module": MODULE,
        "backend": case.backend,
        "layer": {
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "dtype": str(case.dtype).removeprefix("torch."),
        },
        **extra,
    }


def _damage_one_byte(directory: Path) -> str:
    """Flip one byte inside the layer file's w2_qweight; returns that tensor's name."""
    from service.formats.io.safetensors import SafetensorsFile

    path = directory / "moe-layer-00000.safetensors"
    name = f"{MODULE}.w2_qweight"
    with SafetensorsFile(path) as file:
        offset = file.entries[name].start  # absolute
    data = bytearray(path.read_bytes())
    data[offset + 7] ^= 0x01
    path.write_bytes(bytes(data))
    return name


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """Every case through vLLM in one subprocess (one vLLM start-up)."""
    python = _vllm_python()
    root = tmp_path_factory.mktemp("root")
    entries = []
    for case in CASES:
        source = f"src-{case.layout}-{case.bits}-{case.group_size}-{case.symmetric}-{case.dtype}"
        if not (root / source).exists():
            write_synthetic_checkpoint(root / source, case.spec())
        converted = _convert(root, source, f"out-{case.id}", case.backend)
        entries.append(_entry(case.id, case, root / source, converted))
    first = CASES[0]
    damaged = root / "damaged"
    shutil.copytree(root / f"out-{first.id}", damaged)
    damaged_name = _damage_one_byte(damaged)
    entries.append(_entry(CORRUPTED, first, root, damaged, sides=["converted"]))
    tp2 = {"tensor_parallel_size": 2}
    converted_first = root / f"out-{first.id}"
    entries.append(
        _entry(TENSOR_PARALLEL, first, root, converted_first, sides=["converted"], parallel=tp2)
    )
    shapes = {"MOE_CONTROL_VERIFY": "shapes"}
    entries.append(_entry(SHAPES_ONLY, first, root, damaged, sides=["converted"], env=shapes))
    bad = {"MOE_CONTROL_VERIFY": "fast"}
    entries.append(
        _entry(BAD_VERIFY, first, root, root / f"out-{first.id}", sides=["converted"], env=bad)
    )
    changed = root / "changed"
    shutil.copytree(root / f"out-{first.id}", changed)
    manifest = json.loads((changed / MANIFEST_NAME).read_text())
    manifest["created_by"] = "someone else"
    (changed / MANIFEST_NAME).write_text(json.dumps(manifest))
    entries.append(_entry(CHANGED_MANIFEST, first, root, changed, sides=["converted"]))
    entries.append(
        _entry(
            OTHER_MOE_BACKEND,
            first,
            root,
            root / f"out-{first.id}",
            sides=["converted"],
            moe_backend="marlin",
        )
    )
    source = entries[0]["source_dir"]
    batched = _convert(root, Path(source).name, "out-batched", "BATCHED_MARLIN")
    entries.append(_entry(BATCHED, first, root, batched, sides=["converted"]))
    case_dir = tmp_path_factory.mktemp("cases")
    (case_dir / "cases.json").write_text(json.dumps(entries))
    completed = subprocess.run(
        [str(python), str(LOADER), str(case_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "plugin"), "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return case_dir, json.loads((case_dir / "results.json").read_text()), damaged_name


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_converted_layer_equals_vllms_own(
    case: Case, loaded: tuple[Path, dict[str, Any], str]
) -> None:
    case_dir, results, _ = loaded
    source, converted = results[case.id]["source"], results[case.id]["converted"]
    assert source["ok"], source.get("where")
    assert converted["ok"], converted.get("where")
    assert converted["quantization"] == "moe_control"
    # Every parameter of the converted layer was loaded from the checkpoint (what vLLM's
    # model loader checks when it tracks the loading; AutoGPTQ's source layer has bias
    # parameters no checkpoint fills, so vLLM's own side is not held to it).
    assert converted["not_loaded"] == []
    assert (converted["method"], converted["backend"]) == (source["method"], source["backend"])
    assert converted["backend"] == case.backend
    # A linear layer of the converted checkpoint keeps the source's method.
    assert converted["linear_method"] == source["linear_method"]
    theirs = load_file(str(case_dir / f"{case.id}.source.safetensors"))
    ours = load_file(str(case_dir / f"{case.id}.converted.safetensors"))
    assert set(theirs) - set(ours) == set(SOURCE_LEFTOVERS[case.layout]) & set(theirs)
    assert set(ours) <= set(theirs), f"parameters vLLM does not have: {set(ours) - set(theirs)}"
    for name, tensor in ours.items():
        want = theirs[name]
        assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), name
        assert torch.equal(_bytes(tensor), _bytes(want)), f"{case.id}: {name} differs"


def test_a_damaged_tensor_is_refused_by_name(loaded: tuple[Path, dict[str, Any], str]) -> None:
    _, results, name = loaded
    result = results[CORRUPTED]["converted"]
    assert not result["ok"]
    assert result["error_type"] == "ConvertedCheckpointError"
    assert name in result["error"] and "SHA-256" in result["error"]


def test_a_changed_manifest_is_refused(loaded: tuple[Path, dict[str, Any], str]) -> None:
    _, results, _ = loaded
    result = results[CHANGED_MANIFEST]["converted"]
    assert not result["ok"]
    assert result["error_type"] == "ConvertedCheckpointError"
    assert MANIFEST_NAME in result["error"] and "changed after the conversion" in result["error"]


def test_another_moe_backend_is_refused(loaded: tuple[Path, dict[str, Any], str]) -> None:
    _, results, _ = loaded
    result = results[OTHER_MOE_BACKEND]["converted"]
    assert not result["ok"]
    assert result["error_type"] == "ConvertedCheckpointError"
    assert "--moe-backend marlin" in result["error"] and "converted for TRITON" in result["error"]


def test_a_layout_vllm_cannot_select_is_refused(loaded: tuple[Path, dict[str, Any], str]) -> None:
    _, results, _ = loaded
    result = results[BATCHED]["converted"]
    assert not result["ok"]
    assert result["error_type"] == "ConvertedCheckpointError"
    assert "converted for BATCHED_MARLIN" in result["error"]


def test_shapes_only_skips_the_hashes(loaded: tuple[Path, dict[str, Any], str]) -> None:
    """MOE_CONTROL_VERIFY=shapes trades the tensor hashes away: the damaged copy loads."""
    _, results, _ = loaded
    assert results[SHAPES_ONLY]["converted"]["ok"], results[SHAPES_ONLY]["converted"]
    result = results[BAD_VERIFY]["converted"]
    assert not result["ok"] and result["error_type"] == "ConvertedCheckpointError"
    assert "MOE_CONTROL_VERIFY='fast'" in result["error"]


def test_tensor_parallel_experts_are_refused(loaded: tuple[Path, dict[str, Any], str]) -> None:
    """The files hold whole experts in the kernel layout: no rank's slice of them."""
    _, results, _ = loaded
    result = results[TENSOR_PARALLEL]["converted"]
    assert not result["ok"] and result["error_type"] == "ConvertedCheckpointError"
    assert "tp_size=2" in result["error"]
