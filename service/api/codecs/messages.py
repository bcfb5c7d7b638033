"""Messages as plain JSON, the one form every JSON front shows them in (the CLI's `--json`
inventory, the HTTP/JSON API): protobuf's JSON mapping with the proto's field names, every
field, 64-bit integers as numbers; platforms as the oracle's `PlatformProfile.to_json`."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from service.api.codecs import selection as codec
from service.oracle import PlatformProfile


def message_json(message: Message) -> dict[str, Any]:
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


def presets_json(response: Any) -> list[dict[str, Any]]:
    """ListPlatformPresetsResponse: `{"name", "profile"}` per preset, in its order."""
    return [{"name": p.name, "profile": profile_json(p.profile)} for p in response.presets]


def workers_json(response: Any) -> dict[str, Any]:
    """ListWorkersResponse: `{"ready", "ready_workers", "workers": [...]}`; a worker's
    "platform" is None until it reported one."""
    workers = []
    for worker in response.workers:
        entry = message_json(worker)
        entry["platform"] = profile_json(worker.platform) if worker.HasField("platform") else None
        workers.append(entry)
    return {"ready": response.ready, "ready_workers": response.ready_workers, "workers": workers}


def layers_json(response: Any) -> list[dict[str, Any]]:
    """ListLayersResponse: every kept layer."""
    return [message_json(layer) for layer in response.layers]
