"""TLS and mTLS refusals with generated certificates, and the token together with TLS.

tests/integration/test_lifecycle.py shows the accepting side (a verified TLS client, an mTLS
client with its certificate, plaintext and certificate-less clients refused). This covers
what an attacker or a misconfiguration tries next, against real servers on loopback:

| server            | client                                   | outcome                        |
| ----------------- | ---------------------------------------- | ------------------------------ |
| TLS + token       | trusts another CA                        | handshake refused (UNAVAILABLE)|
| TLS + token       | right CA, the certificate's name differs | refused (UNAVAILABLE)          |
| TLS + token       | plaintext, right token                   | refused (UNAVAILABLE)          |
| TLS + token       | TLS, no token / wrong token              | UNAUTHENTICATED                |
| TLS + token       | TLS, right token                         | served                         |
| TLS + token       | TLS, health without token                | SERVING (probes need no token) |
| mTLS              | no client certificate                    | refused (UNAVAILABLE)          |
| mTLS              | certificate from another CA              | refused (UNAVAILABLE)          |
| mTLS              | expired certificate from the right CA    | refused (UNAVAILABLE)          |
| mTLS              | valid certificate                        | served                         |
| TLS, expired cert | trusts the CA                            | refused (UNAVAILABLE)          |

Certificates come from the `openssl` CLI (EC P-256, fast to make; `openssl ca` because
only it sets past validity dates in OpenSSL 3.0). The servers start without waiting for
their worker: SelectBackend for a named platform needs none.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from integration.serverproc import SERVICE, ServerProcess, health_status, launch, wait_for

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc

TOKEN = "tls-and-token-0123456789abcdef"
SPEC = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "desc_act": False,
    },
    "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 4096, "intermediate_size": 14336},
    "platform": "a100",
}
VALID = ("-days", "2")
EXPIRED = ("-startdate", "20200101000000Z", "-enddate", "20200102000000Z")
_CA_CONFIG = """[ca]
default_ca = test
[test]
database = {dir}/{name}.index
new_certs_dir = {dir}
serial = {dir}/{name}.serial
default_md = sha256
policy = anything
unique_subject = no
[anything]
commonName = supplied
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key_and_csr(d: Path, name: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             cwd=d)  # fmt: skip


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)  # fmt: skip
    (d / f"{name}.index").write_text("")
    (d / f"{name}.serial").write_text("01\n")
    (d / f"{name}.cnf").write_text(_CA_CONFIG.format(dir=d, name=name))


def _sign(d: Path, name: str, ca: str, validity: tuple[str, ...], server: bool) -> None:
    _key_and_csr(d, name)
    ext = ["-extfile", "server.ext"] if server else []
    _openssl("ca", "-batch", "-notext", "-config", f"{ca}.cnf", "-cert", f"{ca}.pem",
             "-keyfile", f"{ca}.key", *validity, "-in", f"{name}.csr", "-out", f"{name}.pem",
             *ext, cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CA `ca` (trusted) and `other` (not); server certs valid and expired; client certs
    valid, expired and from the other CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("pki")
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for ca in ("ca", "other"):
        _ca(d, ca)
    _sign(d, "server", "ca", VALID, server=True)
    _sign(d, "server-expired", "ca", EXPIRED, server=True)
    _sign(d, "client", "ca", VALID, server=False)
    _sign(d, "client-expired", "ca", EXPIRED, server=False)
    _sign(d, "client-other", "other", VALID, server=False)
    return d


@contextlib.contextmanager
def running(*args: str) -> Iterator[ServerProcess]:
    """A server that must still run when the test is done with it."""
    process = launch(*args)
    try:
        yield process
        assert process.process.poll() is None, "".join(process.stderr_lines[-40:])
    finally:
        process.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def tls_token(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    with running(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--auth-token-file", str(token_file),
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def mtls(pki: Path) -> Iterator[ServerProcess]:
    with running(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"),
    ) as server:  # fmt: skip
        yield server


def channel(
    server: ServerProcess,
    pki: Path,
    *,
    ca: str = "ca",
    client: str | None = None,
    name: str | None = None,
) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / f"{ca}.pem").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(pki / f"{client}.pem").read_bytes() if client else None,
    )
    options = [("grpc.ssl_target_name_override", name)] if name else []
    return grpc.secure_channel(f"localhost:{server.port}", credentials, options=options)


def select(ch: grpc.Channel, token: str | None = None) -> grpc.StatusCode:
    """SelectBackend's status code through `ch` (a refused handshake is UNAVAILABLE)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    request = pb.SelectBackendRequest(spec_json=json.dumps(SPEC))
    try:
        answer = pb_grpc.MoeControlServiceStub(ch).SelectBackend(
            request, metadata=metadata, timeout=10
        )
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    assert answer.backend == "MARLIN"
    return grpc.StatusCode.OK


def served(server: ServerProcess, pki: Path, **kwargs: str) -> bool:
    """The good client gets through (waiting while the server starts)."""
    token = kwargs.pop("token", None)
    with channel(server, pki, **kwargs) as ch:
        return wait_for(lambda: select(ch, token) is grpc.StatusCode.OK, 30, 0.2)


def test_tls_with_token(tls_token: ServerProcess, pki: Path) -> None:
    assert served(tls_token, pki, token=TOKEN)
    with channel(tls_token, pki, ca="other") as ch:
        assert select(ch, TOKEN) is grpc.StatusCode.UNAVAILABLE
    with channel(tls_token, pki, name="not-this-server.example") as ch:
        assert select(ch, TOKEN) is grpc.StatusCode.UNAVAILABLE
    with tls_token.channel() as plaintext:
        assert select(plaintext, TOKEN) is grpc.StatusCode.UNAVAILABLE
    with channel(tls_token, pki) as ch:
        assert select(ch) is grpc.StatusCode.UNAUTHENTICATED
        assert select(ch, "not-" + TOKEN) is grpc.StatusCode.UNAUTHENTICATED
        assert select(ch, TOKEN) is grpc.StatusCode.OK
        assert health_status(ch, "") == "SERVING"
        assert health_status(ch, SERVICE) in ("SERVING", "NOT_SERVING")
    assert TOKEN not in "".join(tls_token.stderr_lines)


@pytest.mark.parametrize("client", [None, "client-other", "client-expired"])
def test_mtls_refuses(mtls: ServerProcess, pki: Path, client: str | None) -> None:
    assert served(mtls, pki, client="client")
    with channel(mtls, pki, client=client) as ch:
        assert select(ch) is grpc.StatusCode.UNAVAILABLE
    assert served(mtls, pki, client="client"), "a refused client harmed the server"


def test_expired_server_certificate_is_refused(pki: Path) -> None:
    with running(
        "--tls-cert", str(pki / "server-expired.pem"),
        "--tls-key", str(pki / "server-expired.key"),
    ) as server:  # fmt: skip
        with channel(server, pki) as ch:
            # Refused at every try, not only while the server starts.
            codes = {select(ch) for _ in range(3)}
        assert codes == {grpc.StatusCode.UNAVAILABLE}
        assert health_status_refused(server, pki)


def health_status_refused(server: ServerProcess, pki: Path) -> bool:
    """Even health (which needs no token) cannot be reached over an untrusted handshake."""
    with channel(server, pki) as ch:
        try:
            health_status(ch, "", timeout=3)
        except grpc.RpcError as error:
            return error.code() is grpc.StatusCode.UNAVAILABLE
    return False


# -- the HTTP/JSON door: the same TLS settings and token (docs/http.md)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _https(
    server: ServerProcess,
    pki: Path,
    path: str,
    *,
    token: str | None = None,
    client: str | None = None,
) -> int:
    import http.client
    import ssl
    from urllib.parse import urlsplit

    assert server.http_url is not None and server.http_url.startswith("https://")
    where = urlsplit(server.http_url)
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client is not None:
        context.load_cert_chain(str(pki / f"{client}.pem"), str(pki / f"{client}.key"))
    connection = http.client.HTTPSConnection("127.0.0.1", where.port, context=context, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        connection.request("GET", path, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


def test_https_with_token(pki: Path, tmp_path: Path) -> None:
    import http.client

    with running(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--auth-token", TOKEN, "--http-port", str(_free_port()),
    ) as server:  # fmt: skip
        assert _https(server, pki, "/v1/platforms", token=TOKEN) == 200
        assert _https(server, pki, "/v1/platforms") == 401
        assert _https(server, pki, "/v1/platforms", token="wrong") == 401
        assert _https(server, pki, "/healthz") == 200
        assert server.http_url is not None
        plain = http.client.HTTPConnection("127.0.0.1", int(server.http_url.rsplit(":", 1)[1]))
        with pytest.raises((OSError, http.client.HTTPException)):
            plain.request("GET", "/healthz")
            plain.getresponse()
        plain.close()


def test_https_mtls(pki: Path) -> None:
    import ssl

    with running(
        "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
        "--tls-client-ca", str(pki / "ca.pem"), "--http-port", str(_free_port()),
    ) as server:  # fmt: skip
        assert _https(server, pki, "/v1/rulesets", client="client") == 200
        for client in (None, "client-other"):
            with pytest.raises((ssl.SSLError, OSError)):
                _https(server, pki, "/v1/rulesets", client=client)
