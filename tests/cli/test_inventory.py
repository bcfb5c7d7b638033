"""`moe-control presets` and `rulesets` locally, and the connection flags every inventory
command shares (`workers`, `layers`, `unload`) against an address nothing listens on.
tests/integration/test_inventory_cli.py calls a real server."""

from __future__ import annotations

import json
import socket

import pytest

from service.cli import main
from service.oracle import DEFAULT_RULESET, PLATFORM_PRESETS, RULESETS
from service.oracle.releases import RELEASES


def test_presets_list_every_preset_with_what_it_assumes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["presets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in listed] == list(PLATFORM_PRESETS)
    by_name = {p["name"]: p["profile"] for p in listed}
    assert by_name["h200"]["packages"] == ["flashinfer", "humming"]
    assert by_name["mi250x"]["arch"] == "gfx90a"
    assert by_name["rtx4090"]["capability"] == "8.9"


def test_presets_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["PRESET", "DEVICE", "CAPABILITY", "ARCH", "PACKAGES", "ENV"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["h20"] == ["h20", "cuda", "9.0", "-", "flashinfer,humming", "-"]
    assert rows["mi250x"] == ["mi250x", "rocm", "9.0", "gfx90a", "none", "-"]
    assert len(rows) == len(PLATFORM_PRESETS)


def test_rulesets_come_from_the_oracles_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rulesets", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in listed] == list(RULESETS)
    (default,) = [r for r in listed if r["default"]]
    assert default["name"] == DEFAULT_RULESET
    assert default["backends"] == list(RULESETS[DEFAULT_RULESET].backends)
    assert "marlin" in default["moe_backends"]
    assert main(["rulesets"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{next(iter(RULESETS))}\n")  # oldest release first, as listed
    assert f"\n{DEFAULT_RULESET} (default)\n" in out


def test_rulesets_show_each_releases_range_and_pins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rulesets", "--json"]) == 0
    (entry,) = [r for r in json.loads(capsys.readouterr().out) if r["name"] == "vllm-0.33"]
    assert (entry["vllm"], entry["first_version"], entry["below_version"]) == (
        ">=0.33.0,<0.34",
        "0.33.0",
        "0.34",
    )
    assert (entry["torch"], entry["humming_kernels"]) == ("2.14.0", "0.1.19")
    assert main(["rulesets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == next(iter(RELEASES))
    older = lines.index("vllm-0.32")
    assert lines[older : older + 4] == [
        "vllm-0.32",
        "  vllm: >=0.32.0,<0.33",
        "  torch: 2.13.0",
        "  humming-kernels: 0.1.17",
    ]
    start = lines.index("vllm-0.34 (default)")
    assert lines[start : start + 4] == [
        "vllm-0.34 (default)",
        "  vllm: >=0.34.0,<0.35",
        "  torch: 2.14.0",
        "  humming-kernels: 0.1.19",
    ]


def closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    "command", [["workers"], ["layers"], ["unload", "L1"], ["presets"], ["rulesets"]]
)
def test_no_server_is_unavailable_at_once(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # A timeout far beyond the test's own: a client that waited for the server to appear
    # instead of failing at once would never get here.
    assert main([*command, "--server", closed_port(), "--timeout", "3600", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "UNAVAILABLE"


def test_wait_ready_waits_up_to_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    # Without the wait this is UNAVAILABLE at once (exit 3); with it, NOT_READY (exit 1).
    args = ["workers", "--server", closed_port(), "--timeout", "1.5", "--wait-ready"]
    assert main(args) == 1
    assert "error: NOT_READY: not ready after" in capsys.readouterr().err


def test_client_certificate_needs_its_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layers", "--server", closed_port(), "--tls-cert", "cert.pem"]) == 2
    assert "--tls-key" in capsys.readouterr().err
