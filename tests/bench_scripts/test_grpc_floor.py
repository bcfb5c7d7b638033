"""bench/grpc_floor.py on a small scale: each in-process server layer answers the real
presets reply (auth's only with the token), the raw TCP target answers its bytes, and the
table has a row per target with a figure in each mode that target is measured in."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import grpc_floor


def test_the_layers_answer_the_presets_and_the_table_has_each_target() -> None:
    text = grpc_floor.run(["tcp", "bare", "wrapped", "auth"], rounds=1, calls=3)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[4:]}
    assert list(rows) == ["tcp", "bare", "wrapped", "auth"]
    for line in rows.values():
        b2b, gap, scrape = line.split(" | ")[1:4]
        assert float(b2b.split()[0]) > 0 and float(gap.split()[0]) > 0 and scrape == "–"


def test_each_layer_serves_the_same_reply_and_auth_refuses_without_a_token() -> None:
    want = grpc_floor._presets_reply()
    assert len(want.presets) > 0
    auth = grpc_floor.Target("auth")
    try:
        assert auth.call() == want
        stub = grpc_floor.pb_grpc.MoeControlServiceStub(auth.channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListPlatformPresets(grpc_floor.pb.ListPlatformPresetsRequest())
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    finally:
        auth.close()
    tcp = grpc_floor.Target("tcp")
    try:
        assert tcp.call() == want.SerializeToString()
    finally:
        tcp.close()
