"""The plugin's `MOE_CONTROL_REPORT_*` variables: off without an address, every bad value a
clear error the plugin turns into one warning line."""

from __future__ import annotations

from pathlib import Path

import pytest
from moe_control_vllm import settings


def test_no_address_means_off() -> None:
    assert settings.from_environ({}) is None
    assert settings.from_environ({settings.AUTH_TOKEN: "t"}) is None


def test_address_token_and_tls(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    found = settings.from_environ(
        {
            settings.ADDRESS: "moe-control.ns.svc:50151",
            settings.AUTH_TOKEN_FILE: str(token_file),
            settings.TLS_CA: "/ca.pem",
            settings.DEADLINE_S: "2.5",
        }
    )
    assert found is not None
    assert (found.address, found.token, found.tls, found.deadline_s) == (
        "moe-control.ns.svc:50151",
        "s3cret",
        True,
        2.5,
    )


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({settings.ADDRESS: "no-port"}, "HOST:PORT"),
        ({settings.ADDRESS: "h:99999"}, "HOST:PORT"),
        (
            {settings.ADDRESS: "h:1", settings.AUTH_TOKEN: "a", settings.AUTH_TOKEN_FILE: "/f"},
            "not both",
        ),
        (
            {settings.ADDRESS: "h:1", settings.AUTH_TOKEN_FILE: "/nonexistent/token"},
            "AUTH_TOKEN_FILE",
        ),
        ({settings.ADDRESS: "h:1", settings.TLS_CERT: "/c.pem"}, "go together"),
        ({settings.ADDRESS: "h:1", settings.DEADLINE_S: "soon"}, "not a number"),
        ({settings.ADDRESS: "h:1", settings.DEADLINE_S: "0"}, "(0, 60]"),
    ],
)
def test_bad_values_are_named(environ: dict[str, str], says: str) -> None:
    with pytest.raises(
        settings.ReportSettingsError, match=says.replace("(", r"\(").replace("]", r"\]")
    ):
        settings.from_environ(environ)


def test_every_variable_is_documented() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "fleet_truth.md").read_text()
    for name in settings.VARIABLES:
        assert f"`{name}`" in readme, name
