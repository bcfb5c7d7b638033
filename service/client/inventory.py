"""The server's inventory from the client side: its presets, rulesets, workers and kept
layers, and unloading a layer; for `moe-control presets`, `rulesets`, `workers`, `layers`
and `unload`.

Each call returns plain JSON: messages as protobuf's JSON mapping with the proto's field
names (every field, zeros included, so a script never meets a missing key), platforms in
the form the oracle's `PlatformProfile.to_json` gives (the same shape `select --json`
prints). gRPC errors pass through as `grpc.RpcError`; a readiness wait that runs out
raises `ServerNotReadyError`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from service.api.codecs import rulesets as rulesets_codec
from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.client.channel import Connection
from service.oracle import PlatformProfile


def _call(connection: Connection, method: str, request: Message) -> Any:
    """One call in a session: after the readiness wait when `connection.wait_ready`, under
    the connection's deadline, retried as the channel's rules say."""
    with connection.session() as session:
        return session.unary(method, request)


def _json(message: Message) -> dict[str, Any]:
    """Every field with the proto's names; 64-bit integers as numbers (protobuf's JSON
    mapping writes them as strings, which a script would have to convert back)."""
    out: dict[str, Any] = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64_as_numbers(message, out)
    return out


_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _int64_as_numbers(message: Message, out: dict[str, Any]) -> None:
    for field in message.DESCRIPTOR.fields:
        if field.name not in out:
            continue
        if field.type in _INT64_TYPES:
            value = out[field.name]
            out[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            if field.message_type.full_name.startswith("google.protobuf."):
                continue  # well-known types (Timestamp, Duration) keep their JSON strings
            value = out[field.name]
            if isinstance(value, list):
                for sub_message, sub_out in zip(getattr(message, field.name), value, strict=True):
                    _int64_as_numbers(sub_message, sub_out)
            elif isinstance(value, dict):
                _int64_as_numbers(getattr(message, field.name), value)


def profile_json(message: Any) -> dict[str, Any]:
    """A PlatformProfile message as the oracle's JSON form."""
    return PlatformProfile.from_json(codec.platform_to_json(message)).to_json()


def list_presets(connection: Connection) -> list[dict[str, Any]]:
    """ListPlatformPresets: `{"name", "profile"}` per preset, in the server's order."""
    response = _call(connection, "ListPlatformPresets", pb.ListPlatformPresetsRequest())
    return [{"name": p.name, "profile": profile_json(p.profile)} for p in response.presets]


def list_rulesets(connection: Connection) -> list[dict[str, Any]]:
    """ListRulesets: each ruleset as `moe-control rulesets --json` prints it locally."""
    response = _call(connection, "ListRulesets", pb.ListRulesetsRequest())
    return rulesets_codec.rulesets_from_pb(response)


def list_workers(connection: Connection) -> dict[str, Any]:
    """ListWorkers: `{"ready", "ready_workers", "workers": [...]}`; a worker's "platform"
    is None until it reported one."""
    response = _call(connection, "ListWorkers", pb.ListWorkersRequest())
    workers = []
    for worker in response.workers:
        entry = _json(worker)
        entry["platform"] = profile_json(worker.platform) if worker.HasField("platform") else None
        workers.append(entry)
    return {"ready": response.ready, "ready_workers": response.ready_workers, "workers": workers}


def list_layers(connection: Connection, worker_index: int | None = None) -> list[dict[str, Any]]:
    """ListLayers: every kept layer (of one worker when `worker_index` is given)."""
    request = pb.ListLayersRequest()
    if worker_index is not None:
        request.worker_index = worker_index
    response = _call(connection, "ListLayers", request)
    return [_json(layer) for layer in response.layers]


def unload_layer(connection: Connection, layer_id: str) -> int:
    """UnloadLayer: the device bytes freed."""
    response = _call(connection, "UnloadLayer", pb.UnloadLayerRequest(layer_id=layer_id))
    return int(response.freed_bytes)
