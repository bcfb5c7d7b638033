"""The worker side of RunMoE, in process: a kept layer run by id through segments (TRITON
under the interpreter and EMULATION), routing from logits and given top-k, the reference
comparison, and every input error with its category and field, the worker unharmed."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in (
        "service.kernels.align",
        "service.kernels.triton.jit",
        "service.kernels.triton.prefill",
        "service.kernels.triton.decode",
    ):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

from service.formats.io.streaming import TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.quantize import random_layer
from service.ipc.segments import SegmentDir
from service.kernels.activation import resolve
from service.kernels.emulation import reference_forward
from service.kernels.routing import topk_route
from service.pool.segments import SegmentPool
from service.worker.main import Worker
from worker.test_convert_job import Lines, params, put_inputs, request

KIB = 1024

DEPLOYMENT = {
    "layer": {
        "top_k": 2,
        "activation": "silu",
        "routing": {"renormalize": True, "scoring_func": "softmax"},
    }
}


@pytest.fixture(scope="module")
def layer() -> Any:
    return random_layer(
        4, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(3)
    )


class Rig:
    def __init__(self, layer: Any, tmp: Path, device: str = "cpu") -> None:
        self.lines = Lines()
        self.worker = Worker(device, self.lines)
        self.segments = SegmentDir.create(tmp)
        self.calls = 0
        self.layer = layer

    def call(self, method: str, values: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        answer = self.worker.handle(request(self.calls, method, values))
        if answer is not None:
            from service.ipc import protocol

            return protocol.decode(answer)
        return self.lines.answer(self.calls)

    def keep_answer(self, backend: str, **extra: Any) -> dict[str, Any]:
        self.segments.remove("t-in-")
        tensors = write_checkpoint(GPTQ, self.layer, SourceQuantization(4, 32), naming="mixtral")
        values = params(
            self.segments,
            put_inputs(self.segments, tensors),
            backend=backend,
            keep_loaded=True,
            return_tensors=False,
            deployment=DEPLOYMENT,
            **extra,
        )
        values["shape"]["num_experts"] = 4
        return self.call("convert_layer", values)

    def keep(self, backend: str, **extra: Any) -> str:
        return str(self.keep_answer(backend, **extra)["result"]["layer_id"])

    def run(self, inputs: dict[str, torch.Tensor], **extra: Any) -> dict[str, Any]:
        self.segments.remove("t-in-")
        values = {
            "segments_dir": str(self.segments.path),
            "inputs": put_inputs(self.segments, inputs),
            "out_segment": f"t-out-{self.calls}",
            **extra,
        }
        return self.call("run_moe", values)

    def output(self, answer: dict[str, Any]) -> torch.Tensor:
        spec = TensorSpec.from_json(answer["output"]["spec"])
        with self.segments.open(answer["output"]["segment"], spec.byte_size) as segment:
            data = bytearray(segment.view)
        return torch.frombuffer(data, dtype=torch.bfloat16).reshape(spec.shape).clone()


def inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(tokens, 64, generator=gen).to(torch.bfloat16),
        "router_logits": torch.randn(tokens, 4, generator=gen),
    }


def reference(layer: Any, given: dict[str, torch.Tensor]) -> torch.Tensor:
    weights, ids = topk_route(given["router_logits"], 2)
    return reference_forward(layer, given["hidden_states"], ids, weights, resolve("silu"))


@pytest.mark.parametrize("backend", ["TRITON", "EMULATION"])
def test_run_by_id_matches_the_fp32_reference(layer: Any, tmp_path: Path, backend: str) -> None:
    rig = Rig(layer, tmp_path)
    layer_id = rig.keep(backend)
    given = inputs(5)
    answer = rig.run(given, layer_id=layer_id, compare=True)["result"]
    assert answer["backend"] == backend and answer["tokens"] == 5
    out = rig.output(answer).to(torch.float32)
    want = reference(layer, given)
    relative = float((out - want).norm() / want.norm())
    assert relative < 1e-2, relative
    assert answer["max_abs_error"] < 0.05 and answer["device_seconds"] > 0
    stored = rig.worker.layers.get(layer_id)
    assert stored is not None and stored.backend is not None  # prepared once, kept
    prepared = stored.backend
    rig.run(given, layer_id=layer_id)
    assert stored.backend is prepared


def test_the_answer_times_each_stage_in_order(layer: Any, tmp_path: Path) -> None:
    """`stages`: host seconds per stage, in the order run, "compare" only when asked for;
    they cover the forward (at least the device time on a CPU worker) and nothing is
    counted twice (their sum is under the call's own wall time)."""
    import time

    rig = Rig(layer, tmp_path)
    layer_id = rig.keep("EMULATION")
    started = time.perf_counter()
    answer = rig.run(inputs(3), layer_id=layer_id)["result"]
    wall = time.perf_counter() - started
    stages = answer["stages"]
    assert list(stages) == ["open", "layer", "routing", "to_device", "forward", "output"]
    assert all(seconds >= 0 for seconds in stages.values())
    assert stages["forward"] >= answer["device_seconds"]
    assert sum(stages.values()) <= wall
    compared = rig.run(inputs(3), layer_id=layer_id, compare=True)["result"]["stages"]
    assert list(compared)[-2:] == ["compare", "output"]


def test_given_topk_and_emulation_on_a_triton_layer(layer: Any, tmp_path: Path) -> None:
    rig = Rig(layer, tmp_path)
    layer_id = rig.keep("TRITON")
    given = inputs(3)
    weights, ids = topk_route(given["router_logits"], 2)
    answer = rig.run(
        {
            "hidden_states": given["hidden_states"],
            "topk.topk_ids": ids.to(torch.int64),
            "topk.topk_weights": weights,
        },
        layer_id=layer_id,
        backend="EMULATION",
    )["result"]
    assert answer["backend"] == "EMULATION"
    want = reference(layer, given)
    assert float((rig.output(answer).float() - want).norm() / want.norm()) < 1e-2


def _bad(given: dict[str, torch.Tensor], **change: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**given, **change}


#: (case, error category, field): every input error run_moe raises before a kernel runs.
INPUT_ERRORS = [
    ("hidden_size", "invalid_argument", "hidden_states"),
    ("dtype", "invalid_argument", "hidden_states"),
    ("nan", "invalid_argument", "hidden_states"),
    ("inf_logits", "invalid_argument", "router_logits"),
    ("logits_shape", "invalid_argument", "router_logits"),
    ("ids_range", "invalid_argument", "topk.topk_ids"),
    ("unknown_layer", "not_found", "layer_id"),
    ("backend", "invalid_argument", "backend"),
]


@pytest.mark.parametrize(("case", "category", "field"), INPUT_ERRORS)
def test_input_errors_name_the_field_and_leave_the_worker_healthy(
    layer: Any, tmp_path: Path, case: str, category: str, field: str
) -> None:
    rig = Rig(layer, tmp_path)
    check_input_error(rig, rig.keep("EMULATION"), case, category, field)


def check_input_error(rig: Rig, layer_id: str, case: str, category: str, field: str) -> None:
    """One INPUT_ERRORS case on `rig`'s worker (tests/gpu runs them on a CUDA worker, whose
    checks read the host copies of the inputs)."""
    given = inputs(2)
    extra: dict[str, Any] = {"layer_id": layer_id, "validate": True}
    hidden = given["hidden_states"]
    if case == "hidden_size":
        given = _bad(given, hidden_states=torch.zeros(2, 32, dtype=torch.bfloat16))
    elif case == "dtype":
        given = _bad(given, hidden_states=hidden.float())
    elif case == "nan":
        bad = hidden.clone()
        bad[1, 3] = float("nan")
        given = _bad(given, hidden_states=bad)
    elif case == "inf_logits":
        bad = given["router_logits"].clone()
        bad[0, 0] = float("inf")
        given = _bad(given, router_logits=bad)
    elif case == "logits_shape":
        given = _bad(given, router_logits=torch.zeros(2, 5))
    elif case == "ids_range":
        given = {
            "hidden_states": hidden,
            "topk.topk_ids": torch.tensor([[0, 4], [1, 2]], dtype=torch.int32),
            "topk.topk_weights": torch.full((2, 2), 0.5),
        }
    elif case == "unknown_layer":
        extra["layer_id"] = "layer-nope"
    elif case == "backend":
        extra["backend"] = "TRITON"  # a dense EMULATION layer has no TRITON layout
    error = rig.run(given, **extra)["error"]
    assert error["details"]["category"] == category, error
    assert error["details"].get("field", "") == field, error
    ok = rig.run(inputs(2), layer_id=layer_id)
    assert "result" in ok


def test_zero_tokens_and_sigmoid_routing(layer: Any, tmp_path: Path) -> None:
    rig = Rig(layer, tmp_path)
    layer_id = rig.keep("EMULATION")
    empty = rig.run(inputs(0), layer_id=layer_id)["result"]
    assert empty["output"]["spec"]["shape"] == [0, 64] and empty["tokens"] == 0
    stored = rig.worker.layers.get(layer_id)
    assert stored is not None
    stored.deployment = {"layer": {"top_k": 1, "routing": {"scoring_func": "sigmoid"}}}
    given = inputs(3, seed=5)
    answer = rig.run(given, layer_id=layer_id)["result"]
    weights, ids = topk_route(given["router_logits"], 1, scoring_func="sigmoid")
    want = reference_forward(layer, given["hidden_states"], ids, weights, resolve("silu"))
    assert float((rig.output(answer).float() - want).norm() / want.norm()) < 1e-2


def test_keeping_past_the_budget_evicts_the_least_recently_used(layer: Any, tmp_path: Path) -> None:
    rig = Rig(layer, tmp_path)
    first = rig.keep("TRITON")
    size = rig.worker.layers.used_bytes
    second = rig.keep("TRITON", layer_budget_bytes=2 * size)
    assert rig.run(inputs(1), layer_id=first)["result"]  # first is now the most recent
    third = rig.keep("TRITON", layer_budget_bytes=2 * size)
    assert [i["layer_id"] for i in rig.worker.layers.infos()] == [first, third]
    error = rig.run(inputs(1), layer_id=second)["error"]
    assert error["details"]["category"] == "not_found"
    too_big = rig.keep_answer("TRITON", layer_budget_bytes=size - 1)
    assert too_big["error"]["details"]["category"] == "resource_exhausted"
    assert len(rig.worker.layers) == 2


def test_the_output_goes_into_the_segment_the_server_lent_else_a_new_one(
    layer: Any, tmp_path: Path
) -> None:
    """The server lends a pooled segment for the output (out_capacity bytes, larger than
    the output); one too small for it makes the worker write a new segment (out_spill)."""
    rig = Rig(layer, tmp_path)
    layer_id = rig.keep("EMULATION")
    pool = SegmentPool(rig.segments)
    lent = pool.take(5 * 64 * 2)
    lent.view(lent.capacity)[:] = b"\xff" * lent.capacity
    given = inputs(5)
    lend = {"out_segment": lent.name, "out_capacity": lent.capacity, "out_spill": "t-spill"}
    answer = rig.run(given, layer_id=layer_id, **lend)["result"]
    assert answer["output"]["segment"] == lent.name
    out = torch.frombuffer(bytearray(lent.view(5 * 64 * 2)), dtype=torch.bfloat16).reshape(5, 64)
    assert torch.equal(out, rig.output(answer))
    want = reference(layer, given)
    assert float((out.float() - want).norm() / want.norm()) < 1e-2
    assert "t-spill" not in rig.segments.names()
    answer = rig.run(given, layer_id=layer_id, **{**lend, "out_capacity": 5 * 64 * 2 - 1})
    assert answer["result"]["output"]["segment"] == "t-spill"
    assert torch.equal(rig.output(answer["result"]), out)


@pytest.mark.parametrize("backend", ["EMULATION", "TRITON"])
def test_pooled_segments_refilled_call_after_call_are_read_anew(
    layer: Any, tmp_path: Path, backend: str
) -> None:
    check_refilled_segments(Rig(layer, tmp_path), layer, backend)


def check_refilled_segments(rig: Rig, layer: Any, backend: str = "EMULATION") -> None:
    """As the server does: the same pooled input and output segments, refilled with each
    call's bytes through the pool's mapping. The worker keeps its mappings of them
    (MappedSegments) and every call still computes on its own inputs and lands its own
    output; a segment replaced under the same name is read anew too. (tests/gpu runs it on
    a CUDA worker.)"""
    from service.worker.run import _mapped

    layer_id = rig.keep(backend)
    pool = SegmentPool(rig.segments)
    lent = {name: pool.take(4 * KIB) for name in ("hidden_states", "router_logits", "out")}
    values: dict[str, Any] = {
        "segments_dir": str(rig.segments.path),
        "layer_id": layer_id,
        "out_segment": lent["out"].name,
        "out_capacity": lent["out"].capacity,
    }
    mapped = _mapped(str(rig.segments.path))
    outputs = []
    for seed in range(3):
        given = inputs(3, seed)
        values["inputs"] = []
        for name, tensor in given.items():
            data = tensor.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            lent[name].view(len(data))[:] = data
            spec = TensorSpec.of(name, str(tensor.dtype).removeprefix("torch."), tensor.shape)
            values["inputs"].append({"spec": spec.to_json(), "segment": lent[name].name})
        answer = rig.call("run_moe", values)["result"]
        assert answer["output"]["segment"] == lent["out"].name
        nbytes = 3 * 64 * 2
        out = torch.frombuffer(bytearray(lent["out"].view(nbytes)), dtype=torch.bfloat16)
        want = reference(layer, given)
        assert float((out.reshape(3, 64).float() - want).norm() / want.norm()) < 1e-2
        outputs.append(out)
    assert not torch.equal(outputs[0], outputs[1])
    assert mapped.mapped == 3  # each pooled segment mapped once, then kept
    # The server trims a segment and makes another under the same name: read anew.
    given = inputs(3, 7)
    name = lent["hidden_states"].name
    os.unlink(rig.segments.file(name))
    data = given["hidden_states"].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    with rig.segments.new(name, 4 * KIB) as segment:
        segment.view[: len(data)] = data
    lent["router_logits"].view(3 * 4 * 4)[:] = given["router_logits"].numpy().tobytes()
    rig.call("run_moe", values)
    out = torch.frombuffer(bytearray(lent["out"].view(3 * 64 * 2)), dtype=torch.bfloat16)
    want = reference(layer, given)
    assert float((out.reshape(3, 64).float() - want).norm() / want.norm()) < 1e-2
    assert mapped.mapped == 4


@pytest.mark.parametrize("where", ["host", "device"])
def test_routing_before_or_after_the_copy_gives_the_same_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    from service.worker import run

    if where == "device":
        monkeypatch.setattr(run, "HOST_ROUTING_MAX_SCORES", 0)
    check_routing_paths(tmp_path, "cpu")


def check_routing_paths(tmp_path: Path, device: str) -> None:
    """Routed before the copy to the device (small calls, HOST_ROUTING_MAX_SCORES) or after
    it: logits and given top-k both match the reference, the answer has its device time and
    stages, and the checks (NaN/Inf logits, expert ids out of range) still refuse bad input.
    (tests/gpu runs it on a CUDA worker, where the two differ.)"""
    layer = random_layer(
        4, 64, 64, bits=4, group_size=32, symmetric=True, generator=torch.Generator().manual_seed(3)
    )
    rig = Rig(layer, tmp_path, device)
    layer_id = rig.keep("EMULATION")
    given = inputs(6, seed=5)
    want = reference(layer, given)
    answer = rig.run(given, layer_id=layer_id, validate=True, timed=2)["result"]
    out = rig.output(answer).float()
    assert float((out - want).norm() / want.norm()) < 1e-2
    assert answer["device_seconds"] > 0  # on a GPU read after the output came back
    assert list(answer["stages"]) == ["open", "layer", "routing", "to_device", "forward", "output"]
    weights, ids = topk_route(given["router_logits"], 2)
    topk = {
        "hidden_states": given["hidden_states"],
        "topk.topk_ids": ids.to(torch.int64),
        "topk.topk_weights": weights.to(torch.bfloat16),
    }
    out = rig.output(rig.run(topk, layer_id=layer_id, validate=True)["result"]).float()
    assert float((out - want).norm() / want.norm()) < 1e-2
    check_input_error(rig, layer_id, "inf_logits", "invalid_argument", "router_logits")
    check_input_error(rig, layer_id, "ids_range", "invalid_argument", "topk.topk_ids")
