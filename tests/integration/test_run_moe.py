"""RunMoE over real loopback gRPC against a real server with a CPU worker.

A layer converted with keep_loaded runs by id (TRITON under Triton's interpreter, as the
worker's environment says; EMULATION); its output matches the fp32 dequantized reference
within 1e-2 relative (bf16 activations). Inline weights convert on the fly. Every bad input
answers its code naming the field, and the worker is unharmed afterwards (no restart, the
next call succeeds, no segment left behind).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from integration.serverproc import ServerProcess, launch, wait_ready
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.client.convert import Connection, convert_layer_remote, header_for
from service.client.run import deployment_pb, run_request, tensor_from_pb, tensor_to_pb
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.quantize import random_layer
from service.kernels.activation import resolve
from service.kernels.emulation import reference_forward
from service.kernels.routing import topk_route
from service.pool.segments import POOL_IDLE_S

QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
E, H, I, TOP_K = 4, 64, 64, 2  # noqa: E741
MAX_TOKENS = 32
#: bf16 activations against the fp32 reference (relative Frobenius error).
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def segments_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run-segments")


@pytest.fixture(scope="module")
def server(segments_dir: Path) -> Iterator[ServerProcess]:
    process = launch(
        "--segment-dir",
        str(segments_dir),
        "--run-max-tokens",
        str(MAX_TOKENS),
        "--run-max-inline-bytes",
        str(256 * 1024),
        env={"TRITON_INTERPRET": "1"},
    )
    wait_ready(process)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


@pytest.fixture(scope="module")
def layer() -> Any:
    gen = torch.Generator().manual_seed(11)
    return random_layer(E, H, I, bits=4, group_size=32, symmetric=True, generator=gen)


@pytest.fixture(scope="module")
def checkpoint(layer: Any) -> dict[str, torch.Tensor]:
    return write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")


def spec_json(hidden: int = H, intermediate: int = I) -> str:
    layer = {
        "num_experts": E,
        "top_k": TOP_K,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
    }
    return json.dumps({"hf_quantization_config": QUANT, "layer": layer})


def keep(
    server: ServerProcess, tensors: dict[str, torch.Tensor], backend: str, spec: str = ""
) -> str:
    wire = {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }
    header = header_for(
        deployment_json=spec or spec_json(),
        backend=backend,
        keep_loaded=True,
        return_tensors=False,
    )
    result = convert_layer_remote(Connection(server.address, timeout=60), header, wire)
    assert result.summary is not None and result.summary.layer_id
    return result.summary.layer_id


@pytest.fixture(scope="module")
def layer_ids(server: ServerProcess, checkpoint: dict[str, torch.Tensor]) -> dict[str, str]:
    return {b: keep(server, checkpoint, b) for b in ("TRITON", "EMULATION")}


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    return hidden, torch.randn(tokens, E, generator=gen)


def reference(layer: Any, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    weights, ids = topk_route(logits, TOP_K)
    return reference_forward(layer, hidden, ids, weights, resolve("silu"))


def relative(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want).norm() / want.norm())


def rich(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The code and the first field violation's field ("" when none)."""
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else []:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return error.code(), bad.field_violations[0].field
    return error.code(), ""


def leftover(segments_dir: Path) -> list[str]:
    """Segment files of calls that ended (the pool's idle segments are not theirs)."""
    return [
        p.name
        for p in segments_dir.rglob("*")
        if p.is_file() and p.name not in pooled(segments_dir)
    ]


def pooled(segments_dir: Path) -> list[str]:
    """The server's pooled segments (SegmentPool's files), idle between calls."""
    return sorted(p.name for p in segments_dir.rglob("pool-*") if p.is_file())


@pytest.mark.parametrize("backend", ["TRITON", "EMULATION"])
def test_run_by_layer_id_matches_the_reference(
    stub: Any, layer: Any, layer_ids: dict[str, str], backend: str, segments_dir: Path
) -> None:
    hidden, logits = inputs(7)
    request = run_request(
        hidden, layer_id=layer_ids[backend], router_logits=logits, compare=True, iterations=2
    )
    response = stub.RunMoE(request, timeout=120)
    assert response.backend == backend
    out = tensor_from_pb(response.output)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (7, H)
    assert relative(out, reference(layer, hidden, logits)) < TOLERANCE
    assert response.HasField("max_abs_error") and response.max_abs_error < 0.05
    assert response.device_time.ToNanoseconds() > 0
    assert leftover(segments_dir) == []
    kept = pooled(segments_dir)  # hidden states, logits, output
    assert len(kept) == 3
    stub.RunMoE(request, timeout=120)
    assert pooled(segments_dir) == kept  # the same files reused
    deadline = time.monotonic() + POOL_IDLE_S + 10
    while pooled(segments_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pooled(segments_dir) == []  # an idle server keeps none
    listed = {x.layer_id: x for x in stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers}
    info = listed[layer_ids[backend]]
    assert info.device == "cpu" and info.last_used_time.ToNanoseconds() > 0


def test_given_topk_routing(stub: Any, layer: Any, layer_ids: dict[str, str]) -> None:
    hidden, logits = inputs(4, seed=1)
    weights, ids = topk_route(logits, TOP_K)
    request = run_request(hidden, layer_id=layer_ids["EMULATION"], topk=(ids, weights))
    out = tensor_from_pb(stub.RunMoE(request, timeout=60).output)
    assert relative(out, reference(layer, hidden, logits)) < TOLERANCE


def test_inline_weights_convert_on_the_fly(
    stub: Any, layer: Any, checkpoint: dict[str, torch.Tensor]
) -> None:
    hidden, logits = inputs(3, seed=2)
    spec = deployment_pb(QUANT, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I)
    request = run_request(
        hidden, inline=(spec, checkpoint), router_logits=logits, backend="EMULATION"
    )
    response = stub.RunMoE(request, timeout=60)
    assert response.backend == "EMULATION"
    assert relative(tensor_from_pb(response.output), reference(layer, hidden, logits)) < TOLERANCE


def _case(case: str, layer_ids: dict[str, str], checkpoint: dict[str, torch.Tensor]) -> Any:
    hidden, logits = inputs(2, seed=3)
    request = run_request(hidden, layer_id=layer_ids["EMULATION"], router_logits=logits)
    if case == "hidden_size":
        request.hidden_states.CopyFrom(tensor_to_pb("h", torch.zeros(2, 32, dtype=torch.bfloat16)))
    elif case == "dtype":
        request.hidden_states.CopyFrom(tensor_to_pb("h", hidden.float()))
    elif case == "too_many_tokens":
        big = torch.zeros(MAX_TOKENS + 1, H, dtype=torch.bfloat16)
        request.hidden_states.CopyFrom(tensor_to_pb("h", big))
    elif case == "unknown_layer":
        request.layer_id = "layer-0000"
    elif case == "nan":
        bad = hidden.clone()
        bad[0, 0] = float("nan")
        request.hidden_states.CopyFrom(tensor_to_pb("h", bad))
        request.validate_inputs = True
    elif case == "inf_weights":
        weights, ids = topk_route(logits, TOP_K)
        weights[1, 1] = float("inf")
        request = run_request(
            hidden, layer_id=layer_ids["EMULATION"], topk=(ids, weights), validate=True
        )
    elif case == "no_routing":
        request.ClearField("router_logits")
    elif case == "short_data":
        request.router_logits.data = request.router_logits.data[:-4]
    elif case == "logits_shape":
        request.router_logits.CopyFrom(tensor_to_pb("r", torch.zeros(2, E + 1)))
    elif case == "expert_id":
        ids = torch.tensor([[0, E], [1, 2]], dtype=torch.int32)
        request = run_request(
            hidden, layer_id=layer_ids["EMULATION"], topk=(ids, torch.full((2, 2), 0.5))
        )
    elif case == "iterations":
        request.timed_iterations = 1001
    elif case == "wrong_backend":
        request.backend = "TRITON"
    elif case == "inline_too_big":
        spec = deployment_pb(QUANT, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I)
        padded = {**checkpoint, "pad": torch.zeros(256 * 1024, dtype=torch.uint8)}
        request = run_request(hidden, inline=(spec, padded), router_logits=logits)
    return request


ERRORS = {
    "hidden_size": (grpc.StatusCode.INVALID_ARGUMENT, "hidden_states"),
    "dtype": (grpc.StatusCode.INVALID_ARGUMENT, "hidden_states.dtype"),
    "too_many_tokens": (grpc.StatusCode.RESOURCE_EXHAUSTED, "hidden_states.shape[0]"),
    "unknown_layer": (grpc.StatusCode.NOT_FOUND, ""),
    "nan": (grpc.StatusCode.INVALID_ARGUMENT, "hidden_states"),
    "inf_weights": (grpc.StatusCode.INVALID_ARGUMENT, "topk.topk_weights"),
    "no_routing": (grpc.StatusCode.INVALID_ARGUMENT, "routing"),
    "short_data": (grpc.StatusCode.INVALID_ARGUMENT, "router_logits.data"),
    "logits_shape": (grpc.StatusCode.INVALID_ARGUMENT, "router_logits"),
    "expert_id": (grpc.StatusCode.INVALID_ARGUMENT, "topk.topk_ids"),
    "iterations": (grpc.StatusCode.INVALID_ARGUMENT, "timed_iterations"),
    "wrong_backend": (grpc.StatusCode.INVALID_ARGUMENT, "backend"),
    "inline_too_big": (grpc.StatusCode.RESOURCE_EXHAUSTED, "inline_layer.tensors"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_names_its_field_and_leaves_the_worker_unharmed(
    stub: Any,
    layer_ids: dict[str, str],
    checkpoint: dict[str, torch.Tensor],
    case: str,
    segments_dir: Path,
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.RunMoE(_case(case, layer_ids, checkpoint), timeout=60)
    assert rich(caught.value) == ERRORS[case], caught.value.details()
    hidden, logits = inputs(2)
    ok = stub.RunMoE(
        run_request(hidden, layer_id=layer_ids["EMULATION"], router_logits=logits), timeout=60
    )
    assert ok.backend == "EMULATION"
    workers = stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
    assert [w.restarts for w in workers] == [0]
    assert leftover(segments_dir) == []


def test_metrics_count_duration_and_tokens_by_backend(
    server: ServerProcess, stub: Any, layer_ids: dict[str, str]
) -> None:
    import urllib.request

    hidden, logits = inputs(5, seed=4)
    stub.RunMoE(
        run_request(hidden, layer_id=layer_ids["TRITON"], router_logits=logits), timeout=120
    )
    assert server.metrics_url is not None
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    lines = text.splitlines()
    tokens = [
        x for x in lines if x.startswith('moe_control_run_moe_tokens_total{backend="TRITON"}')
    ]
    assert tokens and float(tokens[0].split()[-1]) >= 5
    count = 'moe_control_run_moe_duration_seconds_count{backend="TRITON"}'
    assert any(x.startswith(count) for x in lines)


def test_cli_run_against_the_server(
    server: ServerProcess, layer_ids: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    shape = ["--experts", str(E), "--hidden", str(H), "--intermediate", str(I), "--tokens", "3"]
    assert main(["run", "--server", server.address, "--backend", "emulation", *shape]) == 0
    out = capsys.readouterr().out
    assert "device time" in out and out.rstrip().endswith("ok")
    by_id = ["run", "--server", server.address, "--layer-id", layer_ids["TRITON"], *shape]
    assert main(by_id) == 0
    assert "TRITON" in capsys.readouterr().out


def test_a_backend_the_worker_cannot_run_is_failed_precondition(
    server: ServerProcess, stub: Any
) -> None:
    """A MARLIN layer on a CPU worker: reported, never run with another backend."""
    gen = torch.Generator().manual_seed(12)
    wide = random_layer(E, 128, 128, bits=4, group_size=32, symmetric=True, generator=gen)
    tensors = write_checkpoint(GPTQ, wide, SourceQuantization(4, 32), naming="mixtral")
    layer_id = keep(server, tensors, "MARLIN", spec_json(128, 128))
    hidden = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    logits = torch.randn(2, E, generator=gen)
    with pytest.raises(grpc.RpcError) as caught:
        stub.RunMoE(run_request(hidden, layer_id=layer_id, router_logits=logits), timeout=60)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    status = rpc_status.from_call(caught.value)
    assert status is not None
    failure = error_details_pb2.PreconditionFailure()
    assert any(d.Unpack(failure) for d in status.details)
    assert failure.violations[0].subject == "MARLIN"
    assert "CUDA" in failure.violations[0].description
    stub.UnloadLayer(pb.UnloadLayerRequest(layer_id=layer_id), timeout=10)


def test_inline_weights_convert_under_the_requests_ruleset(stub: Any, segments_dir: Path) -> None:
    """An act-order GPTQ layer inline for MARLIN: vLLM 0.29 converts it (sorted by group),
    the newest release refuses it. Under the request's ruleset 0.29 the conversion goes
    through, so what stops the call is the MARLIN kernel a CPU worker cannot run
    (FAILED_PRECONDITION), not the newest release's refusal (UNIMPLEMENTED)."""
    gen = torch.Generator().manual_seed(13)
    act = random_layer(
        E, 128, 128, bits=4, group_size=32, symmetric=True, act_order=True, generator=gen
    )
    quant = {**QUANT, "desc_act": True}
    tensors = write_checkpoint(
        GPTQ, act, SourceQuantization(4, 32, desc_act=True), naming="mixtral"
    )
    hidden = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    logits = torch.randn(2, E, generator=gen)
    spec = deployment_pb(quant, num_experts=E, top_k=TOP_K, hidden_size=128, intermediate_size=128)
    codes = {}
    for ruleset in ("vllm-0.29", ""):
        request = run_request(
            hidden, inline=(spec, tensors), router_logits=logits, backend="MARLIN"
        )
        request.ruleset = ruleset
        with pytest.raises(grpc.RpcError) as caught:
            stub.RunMoE(request, timeout=60)
        codes[ruleset] = caught.value.code(), caught.value.details()
    assert codes["vllm-0.29"][0] is grpc.StatusCode.FAILED_PRECONDITION, codes
    assert "CUDA" in codes["vllm-0.29"][1]
    assert codes[""][0] is grpc.StatusCode.UNIMPLEMENTED
    assert "act-order" in codes[""][1]
    assert leftover(segments_dir) == []
