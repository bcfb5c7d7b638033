"""What the plugin is told, from `MOE_CONTROL_REPORT_*` environment variables.

Named like the server's settings (`auth_token`, `auth_token_file`, TLS) under the
`MOE_CONTROL_REPORT_` prefix, so one look at a pod's environment says where its vLLM reports
to. Without `MOE_CONTROL_REPORT_ADDRESS` the plugin does nothing at all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

PREFIX = "MOE_CONTROL_REPORT_"
ADDRESS = PREFIX + "ADDRESS"
AUTH_TOKEN = PREFIX + "AUTH_TOKEN"
AUTH_TOKEN_FILE = PREFIX + "AUTH_TOKEN_FILE"
TLS_CA = PREFIX + "TLS_CA"
TLS_CERT = PREFIX + "TLS_CERT"
TLS_KEY = PREFIX + "TLS_KEY"
DEADLINE_S = PREFIX + "DEADLINE_S"

#: Every variable the plugin reads, with its meaning (the README's table).
VARIABLES: Mapping[str, str] = {
    ADDRESS: "HOST:PORT of the moe-control server; unset: the plugin does nothing",
    AUTH_TOKEN: "bearer token, as the server's auth_token",
    AUTH_TOKEN_FILE: "read the token from this file instead (kept out of the environment)",
    TLS_CA: "PEM CA bundle to verify the server; setting any TLS variable turns TLS on",
    TLS_CERT: "PEM client certificate (the server's tls_client_ca, mTLS)",
    TLS_KEY: "PEM private key of the client certificate",
    DEADLINE_S: "seconds one report call may take (default 5)",
}
DEFAULT_DEADLINE_S = 5.0


class ReportSettingsError(ValueError):
    """A `MOE_CONTROL_REPORT_*` variable has a value the plugin cannot use."""


class ReportSettings(NamedTuple):
    address: str
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    deadline_s: float = DEFAULT_DEADLINE_S

    @property
    def tls(self) -> bool:
        return any(p is not None for p in (self.tls_ca, self.tls_cert, self.tls_key))


def _path(environ: Mapping[str, str], name: str) -> Path | None:
    value = environ.get(name, "").strip()
    return Path(value) if value else None


def from_environ(environ: Mapping[str, str] | None = None) -> ReportSettings | None:
    """The settings the environment gives; None when reporting is off (no address).

    Raises `ReportSettingsError` for a value it cannot use (the caller warns once and
    stays off). The token file is read here, at start-up, once."""
    env = os.environ if environ is None else environ
    address = env.get(ADDRESS, "").strip()
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ReportSettingsError(f"{ADDRESS}={address!r} is not HOST:PORT")
    token = env.get(AUTH_TOKEN, "").strip() or None
    token_file = _path(env, AUTH_TOKEN_FILE)
    if token is not None and token_file is not None:
        raise ReportSettingsError(f"give {AUTH_TOKEN} or {AUTH_TOKEN_FILE}, not both")
    if token_file is not None:
        try:
            token = token_file.read_text().strip() or None
        except OSError as exc:
            raise ReportSettingsError(f"{AUTH_TOKEN_FILE}: {exc}") from None
        if token is None:
            raise ReportSettingsError(f"{AUTH_TOKEN_FILE} {token_file} is empty")
    tls_cert, tls_key = _path(env, TLS_CERT), _path(env, TLS_KEY)
    if (tls_cert is None) != (tls_key is None):
        raise ReportSettingsError(f"{TLS_CERT} and {TLS_KEY} go together")
    raw_deadline = env.get(DEADLINE_S, "").strip()
    try:
        deadline = float(raw_deadline) if raw_deadline else DEFAULT_DEADLINE_S
    except ValueError:
        raise ReportSettingsError(f"{DEADLINE_S}={raw_deadline!r} is not a number") from None
    if not 0 < deadline <= 60:
        raise ReportSettingsError(f"{DEADLINE_S} must be in (0, 60] seconds")
    return ReportSettings(
        address=address,
        token=token,
        tls_ca=_path(env, TLS_CA),
        tls_cert=tls_cert,
        tls_key=tls_key,
        deadline_s=deadline,
    )
