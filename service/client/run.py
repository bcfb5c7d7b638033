"""RunMoE from the client side: torch tensors <-> `Tensor` messages, the inline layer's
deployment, and the call itself (for `moe-control run --server` and the tests).

Tensors travel row-major, little-endian, as their raw bytes (bfloat16 included), which is
what the server's checks expect: data length = product(shape) x item size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from service.api.codecs import conversion as convert_codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2, tensor_pb2
from service.client.channel import Connection
from service.client.errors import LayerNotHeldError
from service.formats.io.streaming import FROM_TORCH


def tensor_to_pb(name: str, tensor: torch.Tensor) -> tensor_pb2.Tensor:
    host = tensor.detach().to("cpu").contiguous()
    dtype = FROM_TORCH[str(host.dtype).removeprefix("torch.")]
    data = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return tensor_pb2.Tensor(
        name=name,
        dtype=tensor_pb2.Dtype.Name(convert_codec.dtype_value(dtype)),
        shape=list(host.shape),
        data=data,
    )


def tensor_from_pb(message: tensor_pb2.Tensor) -> torch.Tensor:
    dtype = getattr(torch, convert_codec.dtype_name(message.dtype))
    if not message.data:
        return torch.empty(list(message.shape), dtype=dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(list(message.shape))


def deployment_pb(
    quantization_config: Mapping[str, Any],
    *,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    activation: str = "silu",
    renormalize: bool = True,
    scoring_func: str = "softmax",
) -> selection_pb2.DeploymentSpec:
    """An inline layer's deployment, field by field."""
    return selection_pb2.DeploymentSpec(
        quantization_config=selection_pb2.QuantizationConfig(
            hf_config_json=json.dumps(dict(quantization_config))
        ),
        layer=selection_pb2.MoeLayer(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            activation=activation,
            routing=selection_pb2.RoutingConfig(scoring_func=scoring_func, renormalize=renormalize),
        ),
    )


def run_request(
    hidden_states: torch.Tensor,
    *,
    layer_id: str = "",
    inline: tuple[selection_pb2.DeploymentSpec, Mapping[str, torch.Tensor]] | None = None,
    router_logits: torch.Tensor | None = None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "",
    validate: bool = False,
    compare: bool = False,
    warmup: int = 0,
    iterations: int = 0,
) -> pb.RunMoERequest:
    request = pb.RunMoERequest(
        hidden_states=tensor_to_pb("hidden_states", hidden_states),
        backend=backend,
        validate_inputs=validate,
        compare_with_reference=compare,
        warmup_iterations=warmup,
        timed_iterations=iterations,
    )
    if inline is not None:
        spec, tensors = inline
        request.inline_layer.spec.CopyFrom(spec)
        request.inline_layer.tensors.extend(tensor_to_pb(n, t) for n, t in tensors.items())
    else:
        request.layer_id = layer_id
    if router_logits is not None:
        request.router_logits.CopyFrom(tensor_to_pb("router_logits", router_logits))
    elif topk is not None:
        request.topk.topk_ids.CopyFrom(tensor_to_pb("topk_ids", topk[0]))
        request.topk.topk_weights.CopyFrom(tensor_to_pb("topk_weights", topk[1]))
    return request


def run_remote(connection: Connection, request: pb.RunMoERequest) -> pb.RunMoEResponse:
    """One RunMoE (retried as `channel` says: it is idempotent)."""
    with connection.session() as session:
        response: pb.RunMoEResponse = session.unary("RunMoE", request)
    return response


def held_layer_shape(connection: Connection, layer_id: str) -> dict[str, int]:
    """The shape of a layer a worker holds, from ListLayers: {"experts", "hidden",
    "intermediate"} (the keys of `moe-control run`'s shape flags)."""
    with connection.session() as session:
        listed: pb.ListLayersResponse = session.unary("ListLayers", pb.ListLayersRequest())
    for layer in listed.layers:
        if layer.layer_id == layer_id:
            return {
                "experts": layer.num_experts,
                "hidden": layer.hidden_size,
                "intermediate": layer.intermediate_size,
            }
    held = ", ".join(layer.layer_id for layer in listed.layers) or "none"
    raise LayerNotHeldError(f"no worker holds layer {layer_id!r} (held: {held})")
