"""The backend table is the one list: its rows agree with the classes and the writers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.formats.registry import TARGET_BACKENDS
from service.kernels import registry
from service.kernels.interface import load_backend_class


def test_every_layout_read_has_a_writer() -> None:
    for row in registry.BACKENDS:
        assert set(row.reads) <= set(TARGET_BACKENDS), row
        assert row.layout == row.name, "a backend's converter writes the layout named after it"


@pytest.mark.parametrize("row", registry.BACKENDS, ids=lambda row: row.name)
def test_classes_agree_with_their_rows(row: registry.Backend) -> None:
    cls = load_backend_class(row.experts)
    assert cls.name == row.name
    for layout in row.reads:
        runner = load_backend_class(registry.runner_for(row.name, layout) or "")
        assert layout in runner.layouts
        assert runner.graph_capturable == row.graph_capturable


def test_a_backend_never_runs_a_layout_it_does_not_read() -> None:
    assert registry.runner_for("TRITON", "MARLIN") is None
    assert registry.runner_for("FLASHINFER_TRTLLM", "TRITON") is None
    assert (
        registry.runner_for("EMULATION", "EMULATION")
        == "service.kernels.dense:DenseEmulationExperts"
    )


def test_the_table_is_read_without_torch() -> None:
    """The server process reads the table and never imports torch."""
    code = "import sys, service.kernels.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_classes_take_their_layouts_from_the_table() -> None:
    """`layouts` and `graph_capturable` are set from the rows, not written in the classes."""
    from service.kernels.dense import DenseEmulationExperts
    from service.kernels.emulation import EmulationExperts

    assert DenseEmulationExperts.layouts == frozenset({"EMULATION"})
    assert EmulationExperts.layouts == frozenset(
        {"CANONICAL", "TRITON", "MARLIN", "BATCHED_MARLIN"}
    )
    assert not EmulationExperts.graph_capturable
    triton = load_backend_class("service.kernels.triton.experts:TritonWNA16Experts")
    assert triton.layouts == frozenset({"TRITON"}) and triton.graph_capturable
