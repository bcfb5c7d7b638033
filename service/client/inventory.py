"""The server's inventory from the client side: its presets, rulesets, workers and kept
layers, unloading a layer, and the decisions vLLM processes reported; for `moe-control
presets`, `rulesets`, `workers`, `layers`, `unload` and `observed`.

Each call returns plain JSON: messages as protobuf's JSON mapping with the proto's field
names (every field, zeros included, so a script never meets a missing key), platforms in
the form the oracle's `PlatformProfile.to_json` gives (the same shape `select --json`
prints). gRPC errors pass through as `grpc.RpcError`; a readiness wait that runs out
raises `ServerNotReadyError`.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from service.api.codecs import rulesets as rulesets_codec
from service.api.codecs.messages import layers_json, message_json, presets_json, workers_json
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import observed_pb2
from service.client.channel import Connection


def _call(connection: Connection, method: str, request: Message) -> Any:
    """One call in a session: after the readiness wait when `connection.wait_ready`, under
    the connection's deadline, retried as the channel's rules say."""
    with connection.session() as session:
        return session.unary(method, request)


def list_presets(connection: Connection) -> list[dict[str, Any]]:
    """ListPlatformPresets: `{"name", "profile"}` per preset, in the server's order."""
    response = _call(connection, "ListPlatformPresets", pb.ListPlatformPresetsRequest())
    return presets_json(response)


def list_rulesets(connection: Connection) -> list[dict[str, Any]]:
    """ListRulesets: each ruleset as `moe-control rulesets --json` prints it locally."""
    response = _call(connection, "ListRulesets", pb.ListRulesetsRequest())
    return rulesets_codec.rulesets_from_pb(response)


def list_workers(connection: Connection) -> dict[str, Any]:
    """ListWorkers: `{"ready", "ready_workers", "workers": [...]}`; a worker's "platform"
    is None until it reported one."""
    return workers_json(_call(connection, "ListWorkers", pb.ListWorkersRequest()))


def list_layers(connection: Connection, worker_index: int | None = None) -> list[dict[str, Any]]:
    """ListLayers: every kept layer (of one worker when `worker_index` is given)."""
    request = pb.ListLayersRequest()
    if worker_index is not None:
        request.worker_index = worker_index
    response = _call(connection, "ListLayers", request)
    return layers_json(response)


def unload_layer(connection: Connection, layer_id: str) -> int:
    """UnloadLayer: the device bytes freed."""
    response = _call(connection, "UnloadLayer", pb.UnloadLayerRequest(layer_id=layer_id))
    return int(response.freed_bytes)


def list_observed(connection: Connection, *, mismatches_only: bool = False) -> dict[str, Any]:
    """ListObservedDecisions: `{"deployments": [...], "evicted": n}`, most recently
    reported first, each deployment as the message's JSON mapping."""
    request = observed_pb2.ListObservedDecisionsRequest(mismatches_only=mismatches_only)
    return message_json(_call(connection, "ListObservedDecisions", request))
