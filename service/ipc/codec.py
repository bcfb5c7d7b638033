"""Frozen dataclasses <-> plain JSON values, driven by their field types.

The worker messages (`messages`) are declared as dataclasses and nothing else: this module
turns one into the JSON object the pipe carries and back, checking each value against its
field's type on the way in, so a malformed message is a `ProtocolError` naming the field
rather than a `KeyError` deep inside a job. Nothing is pickled.

A field may be a `bool`, `int`, `float` (an integer is accepted), `str`, `X | None`,
`tuple[X, ...]`, `dict[str, X]`, `Any` (a JSON value passed as it is), another dataclass,
or a class with its own `to_json()` / `from_json(data)` (a `TensorSpec`, a `SourceSpec`:
those are used rather than their fields).
A field with a default may be left out of the JSON object. The converters of a class are
worked out once, on its first use: a message on the RunMoE path is encoded and decoded on
every call.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from service.ipc.errors import ProtocolError

T = TypeVar("T")
_Convert = Callable[[Any, str], Any]
_MISSING = dataclasses.MISSING


def to_json(message: object) -> dict[str, Any]:
    """`message` (a dataclass instance) as a JSON object."""
    kind: Any = type(message)
    encoded: dict[str, Any] = _encoder(kind)(message, "")
    return encoded


def from_json(cls: type[T], data: Any, path: str = "") -> T:
    """A `cls` (a dataclass) from a JSON object; `ProtocolError` naming the field that is
    missing or of the wrong type."""
    kind: Any = cls
    decoded: T = _decoder(kind)(data, path)
    return decoded


def _where(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _wrong(path: str, want: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{path or 'message'}: expected {want}, got {type(value).__name__}")


@functools.cache
def _encoder(tp: Any) -> _Convert:
    if isinstance(tp, type) and hasattr(tp, "to_json"):
        return lambda value, path: value.to_json()
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(tp)]

        def encode_object(value: Any, path: str) -> dict[str, Any]:
            return {name: encode(getattr(value, name), path) for name, encode in fields}

        return encode_object
    origin = typing.get_origin(tp)
    if origin is tuple:
        item = _encoder(typing.get_args(tp)[0])
        return lambda value, path: [item(v, path) for v in value]
    if origin is dict:
        item = _encoder(typing.get_args(tp)[1])
        return lambda value, path: {str(k): item(v, path) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        inner = _encoder(_optional(tp))
        return lambda value, path: None if value is None else inner(value, path)
    return lambda value, path: value


@functools.cache
def _decoder(tp: Any) -> _Convert:
    if isinstance(tp, type) and hasattr(tp, "from_json"):
        return _own_decoder(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _object_decoder(tp)
    origin = typing.get_origin(tp)
    if origin is tuple:
        return _tuple_decoder(tp)
    if origin is dict:
        return _dict_decoder(tp)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(_optional(tp))
        return lambda value, path: None if value is None else inner(value, path)
    if tp is Any:
        return lambda value, path: value
    if tp is bool:
        return _scalar(bool, "a boolean")
    if tp is int:
        return _integer
    if tp is float:
        return _number
    if tp is str:
        return _scalar(str, "a string")
    raise TypeError(f"no JSON form for {tp!r}")


def _object_decoder(cls: type[Any]) -> _Convert:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _decoder(hints[f.name]), _has_default(f)) for f in dataclasses.fields(cls)]

    def decode(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        given: dict[str, Any] = {}
        for name, convert, optional in fields:
            if name in value:
                given[name] = convert(value[name], _where(path, name))
            elif not optional:
                raise ProtocolError(f"{_where(path, name)}: required")
        return cls(**given)

    return decode


def _has_default(found: dataclasses.Field[Any]) -> bool:
    return found.default is not _MISSING or found.default_factory is not _MISSING


def _tuple_decoder(tp: Any) -> _Convert:
    item = _decoder(typing.get_args(tp)[0])

    def decode(value: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(value, list | tuple):
            raise _wrong(path, "an array", value)
        return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))

    return decode


def _dict_decoder(tp: Any) -> _Convert:
    value_type = typing.get_args(tp)[1]
    item = _decoder(value_type)

    def decode(value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        if value_type is Any:
            return dict(value)
        return {str(k): item(v, _where(path, str(k))) for k, v in value.items()}

    return decode


def _own_decoder(cls: type[Any]) -> _Convert:
    def decode(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _wrong(path, "an object", value)
        try:
            return cls.from_json(value)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"{path}: {exc}") from None

    return decode


def _scalar(kind: type[Any], want: str) -> _Convert:
    def decode(value: Any, path: str) -> Any:
        if not isinstance(value, kind):
            raise _wrong(path, want, value)
        return value

    return decode


def _integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(path, "an integer", value)
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(path, "a number", value)
    return float(value)


def _optional(tp: Any) -> Any:
    """X of `X | None` (the only unions a message field may be)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) != 1 or len(typing.get_args(tp)) != 2:
        raise TypeError(f"a message field may only be X | None, not {tp!r}")
    return args[0]
