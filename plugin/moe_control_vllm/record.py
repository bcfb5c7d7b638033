"""What the plugin records, as plain data: vLLM's thread builds these and nothing heavier
(protobuf is imported and the wire messages built on the sending thread, `messages.py`)."""

from __future__ import annotations

from typing import NamedTuple


class Candidate(NamedTuple):
    """One backend's verdict ("selected", "rejected", "not_reached") and vLLM's reason."""

    backend: str
    verdict: str
    reason: str = ""


class WeightKey(NamedTuple):
    dtype: str
    scale_dtype: str
    group_shape: tuple[int, int]
    symmetric: bool


class Decision(NamedTuple):
    """One distinct decision of this process (the fields of observed.proto's
    ObservedDecision)."""

    layer_name: str
    moe_method: str
    integration: str
    deployment_json: str
    weight_key: WeightKey
    may_have_zp: bool
    may_have_bias: bool
    allow_tile_padding: bool
    backend: str = ""
    experts_class: str = ""
    #: (exception class, message) where the call raised.
    error: tuple[str, str] | None = None
    candidates: tuple[Candidate, ...] = ()
    layer_count: int = 1


class Process(NamedTuple):
    """Who reports (data, never a metric label)."""

    host: str
    pod: str
    namespace: str
    pid: int
    vllm_version: str
    plugin_version: str
    model: str
