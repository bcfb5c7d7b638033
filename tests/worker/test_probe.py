"""What a worker reports about its device."""

from __future__ import annotations

import pytest

from service.oracle import PlatformProfile
from service.worker import probe
from service.worker.main import Worker


def test_cpu_probe_is_a_valid_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("VLLM_API_KEY", "do-not-report")
    info = probe.probe("cpu")
    profile = PlatformProfile.from_json(info["platform"])
    assert profile.device == "cpu"
    assert profile.env == {"VLLM_BATCH_INVARIANT": "1"}
    assert info["device"] == "cpu" and info["pid"] > 0


def test_packages_are_found_by_import_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "_has_module", lambda name: name == "humming")
    assert probe.installed_packages() == ["humming"]


def test_without_torch_the_only_device_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "torch_available", lambda: False)
    assert probe.visible_devices() == ["cpu"]


def test_worker_answers_requests_and_reports_bad_ones() -> None:
    worker = Worker("cpu")
    from service.ipc import protocol

    assert protocol.decode(worker.handle(protocol.request(1, "list_layers")))["result"] == {
        "layers": []
    }
    unload = protocol.decode(worker.handle(protocol.request(2, "unload_layer", {"layer_id": "x"})))
    assert unload["result"] == {"found": False, "freed_bytes": 0}
    assert protocol.decode(worker.handle(protocol.request(3, "nope")))["error"]["type"] == (
        "UnknownMethod"
    )
    assert protocol.decode(worker.handle(b"garbage\n"))["error"]["type"] == "ProtocolError"
