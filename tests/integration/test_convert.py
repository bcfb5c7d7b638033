"""ConvertWeights over real gRPC streams against a real server (a CPU worker).

Inline: a layer's tensors streamed in chunks, the converted tensors streamed back equal
what the registry makes of them locally; keep_loaded registers a layer ListLayers shows and
UnloadLayer removes. Bad input of every kind is INVALID_ARGUMENT naming the field, paths
outside the data root PERMISSION_DENIED, backends without a writer UNIMPLEMENTED; after
every call, failed or cancelled, no tensor segment is left. Path mode: a whole synthetic
checkpoint with progress, then a resume that only verifies.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from integration.platforms import oracle_on, worker_platform
from integration.serverproc import ServerProcess
from service.api.codecs import conversion as convert_codec
from service.api.codecs import selection as selection_codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import moe_control_service_pb2_grpc as pb_grpc
from service.api.generated.moe_control.v1 import selection_pb2, tensor_pb2
from service.client.convert import (
    Connection,
    convert_checkpoint_remote,
    convert_layer_remote,
    header_for,
    tensor_requests,
)
from service.formats import registry
from service.formats.checkpoint.plan import MANIFEST_NAME
from service.formats.io.safetensors import SafetensorsFile
from service.formats.io.streaming import FROM_SAFETENSORS, TensorSpec
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.writers import ConversionOptions
from service.oracle import Decision, SelectionError, deployment_from_model_config

SPEC = SyntheticSpec(num_layers=2, num_experts=4, hidden_size=128, intermediate_size=128)
MODULE = "model.layers.0.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("convert")
    root, segments = base / "root", base / "segments"
    segments.mkdir()
    layers = write_synthetic_checkpoint(root / "mixtral", SPEC)
    return {"base": base, "root": root, "segments": segments, "layers": layers}


@pytest.fixture(scope="module")
def server(paths: dict[str, Any]) -> Iterator[ServerProcess]:
    from integration.serverproc import launch, wait_ready

    process = launch("--data-root", str(paths["root"]), "--segment-dir", str(paths["segments"]))
    wait_ready(process)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[Any]:
    with server.channel() as channel:
        yield pb_grpc.MoeControlServiceStub(channel)


@pytest.fixture
def connection(server: ServerProcess) -> Connection:
    return Connection(server.address, timeout=60)


def layer_tensors(
    root: Path, index: int = 0, model: str = "mixtral"
) -> dict[str, tuple[TensorSpec, memoryview]]:
    """Decoder layer `index`'s expert tensors as the checkpoint stores them."""
    out: dict[str, tuple[TensorSpec, memoryview]] = {}
    for shard in sorted((root / model).glob("*.safetensors")):
        file = SafetensorsFile(shard)
        for name, entry in file.entries.items():
            if name.startswith(f"model.layers.{index}.block_sparse_moe.experts."):
                spec = TensorSpec.of(name, FROM_SAFETENSORS[entry.dtype], entry.shape)
                out[name] = (spec, file.raw(name))
    return out


def config_json(root: Path) -> str:
    return (root / "mixtral" / "config.json").read_text()


def leftover_segments(paths: dict[str, Any], timeout: float = 5.0) -> list[str]:
    """Segment files still present (waiting a little: cleanup runs as the call ends)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [str(p) for p in paths["segments"].rglob("*") if p.is_file()]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def field_of(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return str(bad.field_violations[0].field)
    raise AssertionError(f"no BadRequest in {error}")


# ---------------------------------------------------------------------------------------
# Inline


def test_inline_round_trip_matches_the_local_writer(
    paths: dict[str, Any], connection: Connection
) -> None:
    tensors = layer_tensors(paths["root"])
    header = header_for(model_config_json=config_json(paths["root"]), backend="TRITON")
    result = convert_layer_remote(connection, header, tensors, chunk_bytes=4096)
    expected = registry.convert(paths["layers"][0], "TRITON", source="gptq").tensors
    assert set(result.tensors) == {f"{MODULE}.{name}" for name in expected}
    for name, tensor in expected.items():
        spec, data = result.tensors[f"{MODULE}.{name}"]
        assert data == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
        assert spec.sha256 == hashlib.sha256(data).hexdigest()
    summary = result.summary
    assert summary is not None
    assert summary.target_format.backend == "TRITON"
    assert summary.target_format.experts_class == "TritonWNA16Experts"
    assert summary.target_format.attributes["weight_type"] == "uint4b8"
    assert summary.bytes_in == sum(spec.byte_size for spec, _ in tensors.values())
    assert summary.bytes_out == sum(len(d) for _, d in result.tensors.values())
    assert summary.device_time.ToNanoseconds() > 0
    assert [t.name for t in summary.tensors] == list(result.tensors)
    assert not summary.layer_id
    assert leftover_segments(paths) == []


def test_act_order_on_marlin_is_the_rulesets_form(
    paths: dict[str, Any], connection: Connection
) -> None:
    """A GPTQ act-order layer on MARLIN: under a ruleset whose release accepts act-order,
    that release's sorted form (as the local writer makes it for the ruleset); under 0.33,
    which refuses act-order, UNIMPLEMENTED naming the rulesets that convert it."""
    layers = write_synthetic_checkpoint(paths["root"] / "mixtral-act", replace(SPEC, desc_act=True))
    config = (paths["root"] / "mixtral-act" / "config.json").read_text()
    tensors = layer_tensors(paths["root"], model="mixtral-act")
    header = header_for(model_config_json=config, backend="MARLIN", ruleset="vllm-0.29")
    result = convert_layer_remote(connection, header, tensors)
    options = ConversionOptions(ruleset="vllm-0.29")
    expected = registry.convert(layers[0], "MARLIN", source="gptq", options=options).tensors
    assert "w13_g_idx_sort_indices" in expected
    assert set(result.tensors) == {f"{MODULE}.{name}" for name in expected}
    for name, tensor in expected.items():
        _, data = result.tensors[f"{MODULE}.{name}"]
        assert data == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
    header = header_for(model_config_json=config, backend="MARLIN", ruleset="vllm-0.33")
    with pytest.raises(grpc.RpcError) as caught:
        convert_layer_remote(connection, header, tensors)
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED, caught.value.details()
    assert "act-order" in caught.value.details() and "vllm-0.29" in caught.value.details()
    assert leftover_segments(paths) == []


def test_keep_loaded_lists_and_unloads(
    paths: dict[str, Any], connection: Connection, stub: Any
) -> None:
    header = header_for(
        model_config_json=config_json(paths["root"]),
        backend="TRITON",
        keep_loaded=True,
        return_tensors=False,
    )
    result = convert_layer_remote(connection, header, layer_tensors(paths["root"], 1))
    assert result.tensors == {}
    assert result.summary is not None and result.summary.layer_id
    assert len(result.summary.tensors) == 4  # the summary still lists them with checksums
    layer_id = result.summary.layer_id
    layers = stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers
    listed = {layer.layer_id: layer for layer in layers}
    assert layer_id in listed
    info = listed[layer_id]
    assert (info.num_experts, info.hidden_size, info.intermediate_size) == (4, 128, 128)
    assert info.format.backend == "TRITON" and info.byte_size == result.summary.bytes_out
    freed = stub.UnloadLayer(pb.UnloadLayerRequest(layer_id=layer_id), timeout=10)
    assert freed.freed_bytes == info.byte_size
    remaining = stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers
    assert layer_id not in {layer.layer_id for layer in remaining}
    assert leftover_segments(paths) == []


def _tamper(
    tensors: dict[str, tuple[TensorSpec, memoryview]], **change: Any
) -> dict[str, tuple[TensorSpec, memoryview]]:
    name = f"{MODULE}.0.w1.qweight"
    spec, data = tensors[name]
    fields = {
        "name": spec.name,
        "dtype": spec.dtype,
        "shape": spec.shape,
        "byte_size": spec.byte_size,
        "sha256": spec.sha256,
        "packing": spec.packing,
    }
    data = change.pop("data", data)
    fields.update(change)
    return {**tensors, name: (TensorSpec(**fields), data)}


def _renamed(
    tensors: dict[str, tuple[TensorSpec, memoryview]], old: str, new: str
) -> dict[str, tuple[TensorSpec, memoryview]]:
    spec, data = tensors[old]
    out = {k: v for k, v in tensors.items() if k != old}
    out[new] = (TensorSpec.of(new, spec.dtype, spec.shape), data)
    return out


BAD_INPUTS = {
    "checksum": (lambda t: _tamper(t, sha256="0" * 64), "sha256"),
    "wrong dtype": (
        lambda t: _tamper(t, dtype="float32"),
        "0.w1.qweight",
    ),
    "wrong shape": (
        lambda t: _tamper(t, shape=(8, 512), byte_size=8 * 512 * 4),
        "0.w1.qweight",
    ),
    "unknown name": (
        lambda t: _renamed(t, f"{MODULE}.0.w1.qweight", f"{MODULE}.0.w9.qweight"),
        "w9",
    ),
    "unknown tensor of a known projection": (
        lambda t: _renamed(t, f"{MODULE}.0.w1.qweight", f"{MODULE}.0.w1.qweigth"),
        "qweigth",
    ),
    "declared size wrong": (
        lambda t: _tamper(t, byte_size=12),
        "byte_size",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_invalid_argument_naming_the_field(
    case: str, paths: dict[str, Any], connection: Connection
) -> None:
    make, field_part = BAD_INPUTS[case]
    tensors = make(layer_tensors(paths["root"]))
    header = header_for(model_config_json=config_json(paths["root"]), backend="TRITON")
    with pytest.raises(grpc.RpcError) as caught:
        convert_layer_remote(connection, header, tensors)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert field_part in field_of(caught.value)
    assert leftover_segments(paths) == []


def _raw_call(stub: Any, messages: list[pb.ConvertWeightsRequest]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.ConvertWeights(iter(messages), timeout=30))
    return caught.value


def _messages(root: Path, **header: Any) -> list[pb.ConvertWeightsRequest]:
    head = header_for(model_config_json=config_json(root), backend="TRITON", **header)
    return list(tensor_requests(head, layer_tensors(root), 2048))


def test_overrunning_and_short_streams(paths: dict[str, Any], stub: Any) -> None:
    messages = _messages(paths["root"])
    # Overrun: one chunk too many for the first tensor.
    first_chunk = next(i for i, m in enumerate(messages) if m.WhichOneof("message") == "chunk")
    name = messages[first_chunk].chunk.name
    last = max(
        i
        for i, m in enumerate(messages)
        if m.WhichOneof("message") == "chunk" and m.chunk.name == name
    )
    extra = tensor_pb2.TensorChunk(
        name=name,
        offset=messages[last].chunk.offset + len(messages[last].chunk.data),
        data=b"\x00" * 16,
    )
    overrun = [*messages[: last + 1], pb.ConvertWeightsRequest(chunk=extra), *messages[last + 1 :]]
    error = _raw_call(stub, overrun)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == f"tensors[{name}].chunk.data"
    # Short: the stream ends inside the last tensor.
    error = _raw_call(stub, messages[:-1])
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error).endswith(".chunk") and "stopped short" in error.details()
    # A chunk out of order.
    swapped = list(messages)
    swapped[first_chunk], swapped[first_chunk + 1] = swapped[first_chunk + 1], swapped[first_chunk]
    error = _raw_call(stub, swapped)
    assert field_of(error) == f"tensors[{name}].chunk.offset"
    # Headers only, no tensors; a second header.
    error = _raw_call(stub, messages[:1])
    assert field_of(error) == "tensors"
    error = _raw_call(stub, [messages[0], messages[0]])
    assert field_of(error) == "header"
    assert leftover_segments(paths) == []


def test_header_mismatching_the_tensors(paths: dict[str, Any], connection: Connection) -> None:
    config = json.loads(config_json(paths["root"]))
    config["hidden_size"] = 256
    header = header_for(model_config_json=json.dumps(config), backend="TRITON")
    with pytest.raises(grpc.RpcError) as caught:
        convert_layer_remote(connection, header, layer_tensors(paths["root"]))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(caught.value) == "layer.hidden_size"


def test_backends_without_a_writer_are_unimplemented_up_front(
    paths: dict[str, Any], stub: Any
) -> None:
    head = header_for(model_config_json=config_json(paths["root"]), backend="CPU")
    error = _raw_call(stub, [pb.ConvertWeightsRequest(header=head)])
    assert error.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "CPU" in error.details() and "opaque" in error.details()
    head = header_for(model_config_json=config_json(paths["root"]), backend="WARP")
    error = _raw_call(stub, [pb.ConvertWeightsRequest(header=head)])
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(error) == "target_backend"
    # `auto` is vLLM's own choice for the platform: on a CPU without AMX it selects nothing
    # (FAILED_PRECONDITION), with AMX it picks CPU, which has no writer (UNIMPLEMENTED).
    # Both what-if CPUs, then the worker's own (probed from this host's CPU, either kind).
    deployment = deployment_from_model_config(json.loads(config_json(paths["root"])))
    no_amx, amx = oracle_on(deployment, "cpu-noamx"), oracle_on(deployment, "cpu")
    assert isinstance(no_amx, SelectionError) and isinstance(amx, Decision)
    assert amx.backend == "CPU"
    own = oracle_on(deployment, worker_platform(stub))
    for preset, expected in (("cpu-noamx", no_amx), ("cpu", amx), (None, own)):
        head = header_for(model_config_json=config_json(paths["root"]), platform_preset=preset)
        error = _raw_call(stub, [pb.ConvertWeightsRequest(header=head)])
        if isinstance(expected, SelectionError):
            assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, preset
            status = rpc_status.from_call(error)  # type: ignore[arg-type]
            assert status is not None
            failure = selection_pb2.SelectionFailure()
            assert any(detail.Unpack(failure) for detail in status.details)
            assert selection_codec.selection_error_from_pb(failure).to_json() == expected.to_json()
        else:
            assert expected.backend in registry.UNSUPPORTED_BACKENDS
            assert error.code() is grpc.StatusCode.UNIMPLEMENTED, preset
            assert f"cannot write {expected.backend} (vLLM's choice" in error.details()
            assert registry.UNSUPPORTED_BACKENDS[expected.backend] in error.details()


def test_a_cancelled_call_leaves_nothing(paths: dict[str, Any], server: ServerProcess) -> None:
    messages = _messages(paths["root"])
    sent = threading.Event()
    release = threading.Event()

    def requests() -> Iterator[pb.ConvertWeightsRequest]:
        for number, message in enumerate(messages):
            if number == len(messages) // 2:
                sent.set()
                release.wait(10)
            yield message

    with server.channel() as channel:
        call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(requests(), timeout=30)
        assert sent.wait(10)
        deadline = time.monotonic() + 5
        while not any(paths["segments"].rglob("*-in-*")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(paths["segments"].rglob("*-in-*")), "the server holds no segments yet"
        call.cancel()
        release.set()
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() is grpc.StatusCode.CANCELLED
    assert leftover_segments(paths) == []


# ---------------------------------------------------------------------------------------
# Path mode


def test_whole_checkpoint_with_progress_then_resume(
    paths: dict[str, Any], connection: Connection
) -> None:
    events: list[dict[str, Any]] = []
    header = header_for(backend="TRITON", checkpoint=("mixtral", "out/triton"))
    summary = convert_checkpoint_remote(connection, header, events.append)
    assert summary.manifest_path == f"out/triton/{MANIFEST_NAME}"
    assert (summary.layers_converted, summary.layers_skipped) == (2, 0)
    assert summary.backend_chosen_by == "request"
    assert summary.target_format.backend == "TRITON"
    assert summary.bytes_in > 0 and summary.bytes_out > 0
    assert "converted" in {e["stage"] for e in events} and events[-1]["layers_done"] == 2
    manifest = json.loads((paths["root"] / summary.manifest_path).read_text())
    by_name = {t.name: t.sha256 for t in summary.tensors}
    for unit in manifest["units"]:
        for name, tensor in unit.get("tensors", {}).items():
            assert by_name[name] == tensor["sha256"]
    again = convert_checkpoint_remote(connection, header)
    assert (again.layers_converted, again.layers_skipped) == (0, 2)
    assert convert_codec.summary_to_json(again)["manifest_path"] == summary.manifest_path


@pytest.mark.parametrize(
    ("input_dir", "output_dir", "field"),
    [
        ("../outside", "out/x", "checkpoint.input_dir"),
        ("mixtral", "/etc/moe", "checkpoint.output_dir"),
        ("mixtral", "out/../../escape", "checkpoint.output_dir"),
    ],
)
def test_paths_outside_the_root_are_permission_denied(
    connection: Connection, input_dir: str, output_dir: str, field: str
) -> None:
    header = header_for(backend="TRITON", checkpoint=(input_dir, output_dir))
    with pytest.raises(grpc.RpcError) as caught:
        convert_checkpoint_remote(connection, header)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert field_of(caught.value) == field


def test_symlink_out_of_the_root_is_denied(paths: dict[str, Any], connection: Connection) -> None:
    (paths["root"] / "sneaky").symlink_to(paths["base"])
    header = header_for(backend="TRITON", checkpoint=("mixtral", "sneaky/out"))
    with pytest.raises(grpc.RpcError) as caught:
        convert_checkpoint_remote(connection, header)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "symbolic link" in caught.value.details()


@pytest.mark.parametrize("output_dir", ["mixtral", "mixtral/converted"])
def test_an_output_inside_the_input_is_invalid(
    paths: dict[str, Any], connection: Connection, output_dir: str
) -> None:
    before = sorted(p.name for p in (paths["root"] / "mixtral").iterdir())
    header = header_for(backend="TRITON", checkpoint=("mixtral", output_dir))
    with pytest.raises(grpc.RpcError) as caught:
        convert_checkpoint_remote(connection, header)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(caught.value) == "checkpoint.output_dir"
    assert sorted(p.name for p in (paths["root"] / "mixtral").iterdir()) == before


def test_a_refused_conversion_creates_nothing(
    paths: dict[str, Any], connection: Connection
) -> None:
    """An act-order checkpoint for Marlin under a release whose kernel takes no g_idx."""
    spec = replace(SPEC, desc_act=True)
    write_synthetic_checkpoint(paths["root"] / "act-order", spec)
    header = header_for(backend="MARLIN", checkpoint=("act-order", "refused/out"))
    header.ruleset = "vllm-0.33"
    with pytest.raises(grpc.RpcError) as caught:
        convert_checkpoint_remote(connection, header)
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED, caught.value.details()
    assert "act-order" in caught.value.details()
    assert not (paths["root"] / "refused").exists()


def test_missing_checkpoint_is_invalid(connection: Connection) -> None:
    header = header_for(backend="TRITON", checkpoint=("nothing-here", "out/y"))
    with pytest.raises(grpc.RpcError) as caught:
        convert_checkpoint_remote(connection, header)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(caught.value) == "checkpoint.input_dir"


def test_path_mode_needs_a_data_root(server_factory: Any) -> None:
    plain = server_factory()
    header = header_for(backend="TRITON", checkpoint=("mixtral", "out"))
    with pytest.raises(grpc.RpcError) as caught:
        convert_checkpoint_remote(Connection(plain.address, timeout=30), header)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "data root" in caught.value.details()


def test_cancelled_checkpoint_conversion_resumes(
    paths: dict[str, Any], server: ServerProcess, connection: Connection
) -> None:
    spec = SyntheticSpec(num_layers=6, num_experts=8, hidden_size=512, intermediate_size=512)
    write_synthetic_checkpoint(paths["root"] / "bigger", spec)
    header = header_for(backend="TRITON", checkpoint=("bigger", "out/cancelled"))
    with server.channel() as channel:
        call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(
            iter([pb.ConvertWeightsRequest(header=header)]), timeout=60
        )
        for response in call:
            if response.progress.stage == "converted":
                call.cancel()
                break
    out = paths["root"] / "out" / "cancelled"

    def temp_files() -> list[Path]:
        return [p for p in out.rglob("*") if ".tmp-" in p.name]

    deadline = time.monotonic() + 10
    while temp_files() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert temp_files() == []
    summary = convert_checkpoint_remote(connection, header)
    assert summary.layers_converted + summary.layers_skipped == 6
    assert summary.layers_skipped >= 1, "the finished layer was not kept"
    assert (out / MANIFEST_NAME).exists()


def test_cancel_during_the_worker_conversion_unloads_and_frees(
    paths: dict[str, Any], server: ServerProcess, stub: Any
) -> None:
    """Cancelled while the worker converts (keep_loaded): whatever the worker finishes
    afterwards (its output segments, the kept layer) is removed once it answers."""
    spec = SyntheticSpec(num_layers=1, num_experts=8, hidden_size=1024, intermediate_size=1024)
    write_synthetic_checkpoint(paths["root"] / "cancel-late", spec)
    tensors: dict[str, tuple[TensorSpec, memoryview]] = {}
    for shard in sorted((paths["root"] / "cancel-late").glob("*.safetensors")):
        file = SafetensorsFile(shard)
        for name, entry in file.entries.items():
            if ".experts." in name:
                spec_ = TensorSpec.of(name, FROM_SAFETENSORS[entry.dtype], entry.shape)
                tensors[name] = (spec_, file.raw(name))
    config = (paths["root"] / "cancel-late" / "config.json").read_text()
    head = header_for(model_config_json=config, backend="TRITON", keep_loaded=True)
    sent = threading.Event()

    def requests() -> Iterator[pb.ConvertWeightsRequest]:
        yield from tensor_requests(head, tensors)
        sent.set()

    with server.channel() as channel:
        call = pb_grpc.MoeControlServiceStub(channel).ConvertWeights(requests(), timeout=60)
        assert sent.wait(30)
        time.sleep(0.05)
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        layers = stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers
        if not layers and not leftover_segments(paths, timeout=0):
            break
        time.sleep(0.1)
    assert list(stub.ListLayers(pb.ListLayersRequest(), timeout=10).layers) == []
    assert leftover_segments(paths) == []
