"""Security properties as tests, against a real server with a token and small limits.

- The bearer token is compared in constant time (hmac.compare_digest on digests, checked
  in the source) and never written to the logs, nor is a wrong token a client sent.
- Message-size limits hold on unary and streaming calls (RESOURCE_EXHAUSTED), and the
  server keeps serving after them.
- Path mode stays inside the data root: `..`, absolute paths, symlinked directories and
  symlinked shard files are PERMISSION_DENIED. Hard links: a hard link is a directory
  entry inside the root like any other (no path check can tell it from a plain file, and
  whoever made it could already read its data), so reading through one is allowed; what
  confinement must guarantee is that the server never *writes through* one: outputs are
  new files renamed into place, so a hard link planted in the output directory is
  replaced, and the file outside is never modified.
- Nothing is unpickled: no pickle, marshal or shelve in the package, no torch.load
  without weights_only=True, no numpy allow_pickle, no multiprocessing pipes or queues
  (which pickle) between the server and its workers: they speak JSON lines and share
  raw tensor bytes in files.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from integration.serverproc import ServerProcess, launch, wait_ready

from reliability import wire
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.client.convert import Connection, header_for
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint

PACKAGE = Path(__file__).resolve().parents[2] / "service"
TOKEN = "s3cr3t-" + hashlib.sha256(b"moe-control reliability").hexdigest()[:24]
WRONG = [TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "not-the-token-" + TOKEN[::-1]]
LIMIT = 256 * 1024
SYNTH = SyntheticSpec(num_layers=1, num_experts=2, hidden_size=64, intermediate_size=64)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    """A server with a token (from a file), DEBUG logs and a 256 KiB message limit."""
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    write_synthetic_checkpoint(root / "root" / "ckpt", SYNTH)
    process = launch(
        "--data-root", str(root / "root"),
        "--segment-dir", str(root / "segments"),
        "--auth-token-file", str(token_file),
        "--log-level", "DEBUG",
        "--max-receive-message-bytes", str(LIMIT),
    )  # fmt: skip
    wait_ready(process)
    yield process
    process.stop()


def _bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def _connection(server: ServerProcess, token: str | None = TOKEN) -> Connection:
    return Connection(server.address, token=token, timeout=wire.DEADLINE_S)


# ---------------------------------------------------------------------------------------
# Bearer token


def test_token_compared_in_constant_time() -> None:
    source = (PACKAGE / "api" / "bearer.py").read_text()
    assert "hmac.compare_digest(" in source
    # one check for both doors: nothing else in the package compares digests
    comparing = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "compare_digest" in path.read_text()
    )
    assert comparing == ["api/bearer.py"], comparing
    # No ordinary comparison of a token (auth_token, token, token_digest...) anywhere in
    # the package; an emptiness check against "" compares no secret.
    plain = re.compile(r"\b\w*token\w*\s*(?:==|!=)(?!\s*\"\")|(?:==|!=)\s*\w*token\b")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "generated" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if plain.search(line.replace("tokens", "rows"))
    ]
    assert offenders == []


def test_tokens_never_logged(server: ServerProcess) -> None:
    with server.channel() as channel:
        call = channel.unary_unary(
            f"/{wire.SERVICE}/ListWorkers",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for wrong in [*WRONG, ""]:
            with pytest.raises(grpc.RpcError) as caught:
                call(b"", metadata=_bearer(wrong), timeout=wire.DEADLINE_S)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            call(b"", timeout=wire.DEADLINE_S)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
        call(b"", metadata=_bearer(TOKEN), timeout=wire.DEADLINE_S)
        # A call that fails inside (logged at length) while carrying the right token.
        with pytest.raises(grpc.RpcError):
            call_convert = channel.stream_stream(
                f"/{wire.SERVICE}/ConvertWeights",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            list(call_convert(iter([b"\xff"]), metadata=_bearer(TOKEN), timeout=10))
    logs = "".join(server.stderr_lines)
    assert "unhandled error" in logs or "DEBUG" in logs.upper()  # the logs were captured
    for secret in [TOKEN, *WRONG, TOKEN[7:]]:
        assert secret not in logs


# ---------------------------------------------------------------------------------------
# Message-size limits


def test_oversized_unary_request_is_resource_exhausted(server: ServerProcess) -> None:
    big = pb.SelectBackendRequest(spec_json=" " * (LIMIT + 1024)).SerializeToString()
    with server.channel() as channel:
        answer = wire.unary_with(channel, "SelectBackend", big, _bearer(TOKEN))
    assert answer.code is grpc.StatusCode.RESOURCE_EXHAUSTED, answer


def test_oversized_stream_message_is_resource_exhausted(server: ServerProcess) -> None:
    """The oversized message comes first: a header first could be answered (and the call
    ended) before the server reads the big one."""
    chunk = pb.ConvertWeightsRequest(
        chunk={"name": "x", "offset": 0, "data": b"\0" * (LIMIT + 1024)}
    ).SerializeToString()
    with server.channel() as channel:
        answer = wire.stream_with(channel, [chunk], _bearer(TOKEN))
    assert answer.code is grpc.StatusCode.RESOURCE_EXHAUSTED, answer


# ---------------------------------------------------------------------------------------
# Data root


def _path_mode(server: ServerProcess, source: str, target: str) -> wire.Answer:
    header = pb.ConvertWeightsRequest(
        header=header_for(backend="TRITON", checkpoint=(source, target))
    ).SerializeToString()
    with server.channel() as channel:
        return wire.stream_with(channel, [header], _bearer(TOKEN))


@pytest.mark.parametrize(
    ("source", "target", "field"),
    [
        ("../ckpt", "out/a", "checkpoint.input_dir"),
        ("ckpt/../../x", "out/a", "checkpoint.input_dir"),
        ("ckpt", "out/../../escape", "checkpoint.output_dir"),
        ("/etc", "out/a", "checkpoint.input_dir"),
        ("ckpt", "/tmp/moe-control-escape", "checkpoint.output_dir"),
    ],
)
def test_dot_dot_and_absolute_paths_denied(
    server: ServerProcess, source: str, target: str, field: str
) -> None:
    answer = _path_mode(server, source, target)
    assert answer.code is grpc.StatusCode.PERMISSION_DENIED, answer
    assert field in answer.details


def test_symlinks_out_of_the_root_denied(server: ServerProcess, root: Path) -> None:
    outside = root / "outside"
    write_synthetic_checkpoint(outside / "ckpt", SYNTH)
    (root / "root" / "linked-dir").symlink_to(outside / "ckpt")
    answer = _path_mode(server, "linked-dir", "out/linked-dir")
    assert answer.code is grpc.StatusCode.PERMISSION_DENIED, answer
    # A checkpoint inside the root whose shard is a symlink to a file outside it.
    shard_linked = root / "root" / "shard-linked"
    shutil.copytree(root / "root" / "ckpt", shard_linked)
    shard = next(shard_linked.glob("*.safetensors"))
    shard.unlink()
    shard.symlink_to(next((outside / "ckpt").glob("*.safetensors")))
    answer = _path_mode(server, "shard-linked", "out/shard-linked")
    assert answer.code is grpc.StatusCode.PERMISSION_DENIED, answer
    assert not (root / "root" / "out" / "shard-linked" / shard.name).exists()


def test_hard_links_are_read_but_never_written_through(server: ServerProcess, root: Path) -> None:
    outside = root / "outside-file.json"
    outside.write_text('{"model": {"type": "outside"}}')
    before = outside.read_bytes()
    linked = root / "root" / "hard-linked"
    shutil.copytree(root / "root" / "ckpt", linked)
    (linked / "tokenizer.json").unlink()
    os.link(outside, linked / "tokenizer.json")
    # Reading through a hard link: allowed (documented in the module docstring).
    first = _path_mode(server, "hard-linked", "out/hard-linked")
    assert first.code is grpc.StatusCode.OK, first
    copied = root / "root" / "out" / "hard-linked" / "tokenizer.json"
    assert copied.read_bytes() == before
    assert copied.stat().st_ino != outside.stat().st_ino
    # A hard link planted where the output goes: a re-run replaces it, never writes to it.
    copied.unlink()
    os.link(outside, copied)
    (linked / "tokenizer.json").unlink()
    (linked / "tokenizer.json").write_text('{"model": {"type": "changed"}}')
    again = _path_mode(server, "hard-linked", "out/hard-linked")
    wire.check(again)
    assert outside.read_bytes() == before


# ---------------------------------------------------------------------------------------
# Nothing unpickled

FORBIDDEN = [
    (re.compile(r"^\s*(?:import|from)\s+(?:c?pickle|dill|cloudpickle|marshal|shelve)\b"), "pickle"),
    (re.compile(r"\bpickle\.loads?\("), "pickle.load"),
    (re.compile(r"\btorch\.load\((?![^)]*weights_only=True)"), "torch.load without weights_only"),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle"),
    (re.compile(r"^\s*(?:import|from)\s+multiprocessing\b"), "multiprocessing (pickling pipes)"),
    (re.compile(r"\b(?:Pipe|SimpleQueue|Queue|Manager)\(\).*multiprocessing"), "mp pipe"),
]


def test_nothing_is_unpickled() -> None:
    samples = [
        "import pickle",
        "from cloudpickle import loads",
        "x = pickle.loads(data)",
        "state = torch.load(path)",
        "np.load(f, allow_pickle=True)",
        "import multiprocessing",
    ]
    assert all(any(p.search(line) for p, _ in FORBIDDEN) for line in samples)
    assert not any(p.search("torch.load(path, weights_only=True)") for p, _ in FORBIDDEN)
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {what}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "generated" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for pattern, what in FORBIDDEN
        if pattern.search(line)
    ]
    assert offenders == []


def test_worker_protocol_is_json_lines() -> None:
    protocol = (PACKAGE / "ipc" / "protocol.py").read_text()
    assert "json.loads" in protocol and "pickle" not in protocol.replace("nothing pickled", "")
