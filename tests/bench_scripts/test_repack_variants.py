"""bench/repack_variants.py: the variants only the benchmarks run give the package's bytes.

The int4 Marlin table kernels against the routes' torch transforms (random words, under
Triton's interpreter on the CPU) and through a whole layer against the canonical route, as
the dedicated kernels that replaced them are checked in tests/formats/routes/; the
canonical whole-checkpoint converter against the job's own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

from bench import repack_variants
from service.formats.checkpoint.converter import registry_converter
from service.formats.checkpoint.plan import find_moe_layers, plan_job
from service.formats.io.paths import DataRoot
from service.formats.io.safetensors import SafetensorsFile
from service.formats.routes import gpu_repack
from service.formats.routes.canonical import canonical
from service.formats.routes.direct import ROUTES
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.writers import ConvertedLayer
from service.oracle import preset
from tests.formats.routes.test_direct import E, _checkpoint, _same
from tests.formats.routes.test_gpu_repack import DEVICE, SHAPES, _both

TABLE_ROUTES = sorted(
    (layout, backend, bits)
    for (layout, backend), table in repack_variants.TABLE_KERNELS.items()
    for bits in table
)


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels run on this test's device (the CPU under the interpreter)."""
    monkeypatch.setattr(gpu_repack, "KERNEL_DEVICES", {"cuda", DEVICE.type})


@pytest.mark.parametrize(("layout", "backend", "bits"), TABLE_ROUTES)
def test_table_kernel_equals_torch_transform(layout: str, backend: str, bits: int) -> None:
    kernel = repack_variants.TABLE_KERNELS[(layout, backend)][bits]
    assert isinstance(kernel, gpu_repack.Repack) and kernel.kind == "table"
    for seed, (n, k) in enumerate(SHAPES[(layout, backend)]):
        _both(layout, backend, bits, n=n, k=k, seed=seed, kernel=kernel)


def test_try_table_launches_the_table_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`try_table` launches the table kernel (one per projection), same bytes."""
    kinds: list[str] = []
    real = gpu_repack._launch

    def spy(repack: gpu_repack.Repack, *args: object) -> None:
        kinds.append(repack.kind)
        real(repack, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu_repack, "_launch", spy)
    for layout in ("gptq", "awq"):
        tensors, quant = _checkpoint(layout, group=128)
        want = canonical(layout, tensors, quant, "MARLIN", num_experts=E)
        on_device = {name: t.to(DEVICE) for name, t in tensors.items()}
        got = repack_variants.try_table(layout, on_device, quant, "MARLIN", num_experts=E)
        assert got is not None and kinds == ["table", "table"]
        _same(ConvertedLayer({n: t.cpu() for n, t in got.tensors.items()}, got.descriptor), want)
        kinds.clear()


def test_compiled_weights_compile_each_transform_once() -> None:
    route = ROUTES[("gptq", "TRITON")]
    first = repack_variants.compiled_weights(route, 4, torch.device("cpu"))
    assert first is repack_variants.compiled_weights(route, 8, torch.device("cpu"))
    assert first is not route.weight[4]


def test_canonical_converter_gives_the_jobs_bytes(tmp_path: Path) -> None:
    spec = SyntheticSpec(num_layers=1, fast=True)
    write_synthetic_checkpoint(tmp_path / "in", spec)
    job = plan_job(
        tmp_path / "in",
        tmp_path / "out",
        root=DataRoot(tmp_path.resolve()),
        platform=preset("h200"),
        backend="MARLIN",
    )
    names = sorted(p.name for p in (tmp_path / "in").glob("*.safetensors"))
    files = {name: SafetensorsFile(tmp_path / "in" / name) for name in names}
    try:
        layers, _ = find_moe_layers({name: list(f.entries) for name, f in files.items()})
        layer = layers[0]
        tensors = {k: files[t.file].tensor(t.name) for k, t in layer.tensors.items()}
        want, want_descriptor = registry_converter(job)(layer, tensors)
        got, got_descriptor = repack_variants.canonical_converter(job)(layer, tensors)
    finally:
        for file in files.values():
            file.close()
    assert got_descriptor == want_descriptor and list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
