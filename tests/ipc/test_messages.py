"""The typed worker contract: every request and answer survives its JSON form, a malformed
one is a ProtocolError naming the field, and every method has exactly one handler."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.formats.io.streaming import TensorSpec
from service.formats.routes.spec import SourceSpec
from service.ipc import codec, protocol
from service.ipc.errors import ProtocolError
from service.ipc.messages import (
    REQUESTS,
    BackendsMeasured,
    BackendTiming,
    Cancel,
    ConvertLayer,
    InlineWeights,
    LayerShape,
    MoeRan,
    Ping,
    RunMoE,
    SegmentTensor,
)
from service.oracle import DEFAULT_RULESET
from service.worker.main import BACKGROUND, Worker

SPEC = TensorSpec.of("hidden_states", "bfloat16", (2, 64))
SHAPE = LayerShape(4, 64, 64)


def through_the_pipe(message: Any) -> Any:
    """`message` encoded, sent as one protocol line, read back and decoded."""
    line = protocol.request(1, "m", codec.to_json(message))
    return codec.from_json(type(message), protocol.decode(line)["params"])


@pytest.mark.parametrize(
    "message",
    [
        Ping(),
        Cancel(7),
        RunMoE(
            segments_dir="/dev/shm/x",
            inputs=(SegmentTensor(SPEC, "pool-1"),),
            out_segment="pool-2",
            out_capacity=256,
            inline=InlineWeights(
                tensors=(SegmentTensor(SPEC, "pool-3"),),
                source=SourceSpec("gptq", 4, 32, desc_act=True),
                backend="MARLIN",
                ruleset="vllm-0.29",
                shape=SHAPE,
                deployment={"layer": {"top_k": 2}},
            ),
            backend="MARLIN",
            compare=True,
        ),
        MoeRan("TRITON", 2, SegmentTensor(SPEC, "pool-2"), 1e-4, None, {"open": 1e-5}),
        BackendsMeasured(
            "cpu", {"torch": "2"}, (BackendTiming("EMULATION", {"1": 0.5}), BackendTiming("X"))
        ),
    ],
)
def test_a_message_survives_its_json_form(message: Any) -> None:
    assert through_the_pipe(message) == message


def test_every_method_is_one_request_type_with_one_handler() -> None:
    worker = Worker("cpu")
    for method, kind in REQUESTS.items():
        assert method == kind.METHOD
        assert (kind in BACKGROUND) is kind.BACKGROUND
        assert (kind in BACKGROUND) != (kind in worker.handlers), method


def test_a_ruleset_is_required_wherever_weights_are_converted() -> None:
    """Leaving it out is a malformed request, not the newest release's rules by default."""
    layer = codec.to_json(
        ConvertLayer("/d", (), SourceSpec("gptq", 4, 32), "TRITON", DEFAULT_RULESET, SHAPE, "o-")
    )
    del layer["ruleset"]
    with pytest.raises(ProtocolError, match=r"convert_layer\.ruleset: required"):
        codec.from_json(ConvertLayer, layer, "convert_layer")
    inline = codec.to_json(
        InlineWeights((), SourceSpec("gptq", 4, 32), "TRITON", DEFAULT_RULESET, SHAPE)
    )
    del inline["ruleset"]
    with pytest.raises(ProtocolError, match=r"run_moe\.inline\.ruleset: required"):
        codec.from_json(InlineWeights, inline, "run_moe.inline")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"call_id": "7"}, "cancel.call_id"),
        ({"call_id": True}, "cancel.call_id"),
        ({"call_id": 1.5}, "cancel.call_id"),
        ({}, "cancel.call_id"),
    ],
)
def test_a_wrong_type_names_its_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError, match=field.replace(".", r"\.")):
        codec.from_json(Cancel, params, "cancel")


def test_the_worker_answers_a_malformed_request_with_a_protocol_error() -> None:
    worker = Worker("cpu")
    answer = worker.handle(protocol.request(3, "run_moe", {"segments_dir": 1}))
    assert answer is not None
    error = json.loads(answer)["error"]
    assert error["type"] == "ProtocolError" and "run_moe.segments_dir" in error["message"]
    unknown = json.loads(worker.handle(protocol.request(4, "nope", {})) or b"{}")
    assert unknown["error"]["type"] == "UnknownMethod"
