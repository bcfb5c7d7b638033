"""Structured logs: one JSON object per line on stderr (or plain text for humans).

Fields passed with `extra={...}` become keys of the object, so log lines can be queried
(`jq 'select(.event == "worker_restart")'`); in text, they follow the message as
`key=value` pairs (logfmt's form), so neither format loses a field.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

#: Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def _timestamp(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was given with `extra={...}`, in the order given."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD and not key.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", ...extra, "exc"}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(extra_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`TS LEVEL logger: message key=value ...`, then the traceback if any. A value with a
    space, quote or `=` is quoted (JSON string rules); others (numbers, lists) as JSON."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        pairs = [f"{key}={_text_value(value)}" for key, value in extra_fields(record).items()]
        if pairs:
            line += " " + " ".join(pairs)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        plain = value and not any(c.isspace() or c in "\"=" for c in value)
        return value if plain else json.dumps(value)
    return json.dumps(value, default=str, separators=(",", ":"))


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Route the root logger to stderr in the chosen format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
