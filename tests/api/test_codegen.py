"""The checked-in generated code is exactly what `make protos` writes from protos/."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from service.api import codegen


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    written = codegen.generate(tmp_path)
    assert written, "no code generated"
    checked_in = {
        p.relative_to(codegen.GENERATED_ROOT)
        for p in codegen.GENERATED_ROOT.rglob("*_pb2*.py*")
        if "__pycache__" not in p.parts
    }
    assert set(written) == checked_in, "generated files differ from the checked-in set"
    stale = [
        str(p)
        for p in written
        if (tmp_path / p).read_text() != (codegen.GENERATED_ROOT / p).read_text()
    ]
    assert not stale, f"checked-in code drifted from protos/ (run `make protos`): {stale}"


def test_generated_modules_import_as_a_package() -> None:
    for proto in codegen.proto_files():
        module = importlib.import_module(codegen.module_name(proto))
        package = ".".join(proto.relative_to(codegen.PROTO_ROOT).parent.parts)
        assert module.DESCRIPTOR.package == package
    grpc_module = importlib.import_module(
        "service.api.generated.moe_control.v1.moe_control_service_pb2_grpc"
    )
    assert hasattr(grpc_module, "MoeControlServiceServicer")


def test_plugin_code_matches_its_protos(tmp_path: Path) -> None:
    """The vLLM plugin's own message modules are what `make protos` writes."""
    pytest.importorskip("grpc_tools")
    written = codegen.generate_plugin(tmp_path)
    assert written, "no plugin code generated"
    checked_in = {
        p.relative_to(codegen.PLUGIN_GENERATED_ROOT)
        for p in codegen.PLUGIN_GENERATED_ROOT.rglob("*_pb2.py*")
        if "__pycache__" not in p.parts
    }
    assert set(written) == checked_in, "plugin's generated files differ from the checked-in set"
    stale = [
        str(p)
        for p in written
        if (tmp_path / p).read_text() != (codegen.PLUGIN_GENERATED_ROOT / p).read_text()
    ]
    assert not stale, f"the plugin's code drifted from protos/ (run `make protos`): {stale}"
