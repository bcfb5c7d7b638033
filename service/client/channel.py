"""Channels to a moe-control server and the call metadata every client sends: TLS (and
mTLS) when asked for, the bearer token from the caller or the environment."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import grpc

#: Read when no token is passed (the same variable the server reads).
TOKEN_ENV = "MOE_CONTROL_AUTH_TOKEN"


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def open_channel(
    target: str,
    *,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    tls: bool | None = None,
) -> grpc.Channel:
    """A channel to `target` (HOST:PORT): TLS when a CA or client cert is given (or tls=True),
    with the client cert for mTLS."""
    use_tls = tls if tls is not None else any(p is not None for p in (tls_ca, tls_cert, tls_key))
    if not use_tls:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca),
        private_key=_read(tls_key),
        certificate_chain=_read(tls_cert),
    )
    return grpc.secure_channel(target, credentials)


def call_metadata(token: str | None) -> Sequence[tuple[str, str]]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else ()
