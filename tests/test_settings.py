"""Settings: flags over MOE_CONTROL_* environment variables over defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.settings import Settings, SettingsError, worker_setting


def parse(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    return Settings.load(parser.parse_args(argv), env or {})


def test_defaults() -> None:
    settings = parse([])
    assert (settings.host, settings.port, settings.metrics_port) == ("127.0.0.1", 50151, 9464)
    assert not settings.tls_enabled
    assert settings.token() is None


def test_flags_win_over_environment() -> None:
    env = {"MOE_CONTROL_PORT": "6000", "MOE_CONTROL_MAX_CONCURRENT_RPCS": "7"}
    settings = parse(["--port", "7000"], env)
    assert settings.port == 7000
    assert settings.max_concurrent_rpcs == 7


def test_booleans_and_paths_from_the_environment(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    env = {"MOE_CONTROL_METRICS_ENABLED": "false", "MOE_CONTROL_AUTH_TOKEN_FILE": str(token)}
    settings = parse([], env)
    assert settings.metrics_enabled is False
    assert settings.token() == "abc"
    assert parse(["--metrics-enabled"], env).metrics_enabled is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "port must be in 0..65535"),
        (["--port", "http"], "--port: bad value"),
        (["--tls-key", "k.pem"], "tls_cert and tls_key go together"),
        (["--tls-client-ca", "ca.pem"], "needs tls_cert"),
        (["--log-format", "xml"], "log_format"),
        (["--auth-token", "a", "--auth-token-file", "f"], "not both"),
    ],
)
def test_bad_values_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse(argv)


def test_grpc_options_carry_the_limits() -> None:
    options = dict(parse(["--max-receive-message-bytes", "1024"]).grpc_options())
    assert options["grpc.max_receive_message_length"] == 1024
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == 10000


def test_every_setting_has_its_help_text() -> None:
    import dataclasses

    undocumented = [f.name for f in dataclasses.fields(Settings) if not f.metadata.get("help")]
    assert not undocumented, (
        f"settings without help (the reference is made from it): {undocumented}"
    )
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    text = parser.format_help()
    assert "[env MOE_CONTROL_MAX_CONCURRENT_RPCS; default 512]" in " ".join(text.split())


def test_server_processes_default_to_the_usable_cores(tmp_path: Path) -> None:
    from service.settings import usable_cpus

    assert Settings(server_processes=3).process_count() == 3
    assert Settings().process_count() == usable_cpus() >= 1
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: 2 processes
    assert usable_cpus(cpu_max) == min(2, usable_cpus(tmp_path / "none"))
    cpu_max.write_text("max 100000\n")
    assert usable_cpus(cpu_max) == usable_cpus(tmp_path / "none")
    with pytest.raises(SettingsError):
        Settings(server_processes=-1)
    options = dict(Settings().grpc_options(reuseport=True))
    assert options["grpc.so_reuseport"] == 1
    assert dict(Settings().grpc_options())["grpc.so_reuseport"] == 0


# ---------------------------------------------------------------------------------------
# Every MOE_CONTROL_* variable is a setting; the workers' reach them through their env


def test_every_moe_control_variable_the_service_names_is_a_setting() -> None:
    import dataclasses
    import re

    package = Path(__file__).resolve().parents[1] / "service"
    declared = {Settings.env_name(f.name) for f in dataclasses.fields(Settings)}
    named = {
        f"{path.relative_to(package)}: {match}"
        for path in package.rglob("*.py")
        if "generated" not in path.parts
        for match in re.findall(r"MOE_CONTROL_[A-Z][A-Z0-9_]*", path.read_text())
        if match not in declared
    }
    assert named == set()


@pytest.mark.parametrize(
    ("argv", "env", "decode", "library"),
    [
        ([], {}, True, None),
        (["--no-triton-decode"], {}, False, None),
        ([], {"MOE_CONTROL_TRITON_DECODE": "0"}, False, None),
        (["--marlin-library", "/opt/lib/m.so"], {}, True, Path("/opt/lib/m.so")),
        ([], {"MOE_CONTROL_MARLIN_LIBRARY": "/x/m.so"}, True, Path("/x/m.so")),
    ],
)
def test_a_workers_settings_reach_it_through_its_environment(
    argv: list[str], env: dict[str, str], decode: bool, library: Path | None
) -> None:
    handed = parse(argv, env).worker_environ()
    assert worker_setting("triton_decode", handed) is decode
    assert worker_setting("marlin_library", handed) == library


def test_a_worker_setting_unset_is_its_default_and_a_bad_one_is_named() -> None:
    assert worker_setting("triton_decode", {}) is True
    assert worker_setting("marlin_library", {}) is None
    with pytest.raises(SettingsError, match="MOE_CONTROL_TRITON_DECODE"):
        worker_setting("triton_decode", {"MOE_CONTROL_TRITON_DECODE": "maybe"})
    with pytest.raises(KeyError):
        worker_setting("port", {})
