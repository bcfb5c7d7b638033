"""Both log formats carry every field a log call gives (`extra={...}`)."""

from __future__ import annotations

import json
import logging

import pytest

from service.logs import JsonFormatter, TextFormatter


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord("moe_control.server", logging.INFO, __file__, 1, "serving", (), None)
    record.__dict__.update(extra)
    return record


FIELDS = {"event": "serving", "grpc": "127.0.0.1:50151", "processes": 2, "devices": ["cpu"]}


def test_text_logs_carry_the_fields_as_key_value_pairs() -> None:
    line = TextFormatter().format(_record(**FIELDS))
    assert line.endswith(
        'INFO moe_control.server: serving event=serving grpc=127.0.0.1:50151 processes=2 '
        'devices=["cpu"]'
    ), line


def test_text_values_with_spaces_or_equals_are_quoted() -> None:
    line = TextFormatter().format(_record(reason="worker 0 died", spec="a=b", empty=""))
    assert line.endswith('reason="worker 0 died" spec="a=b" empty=""'), line


def test_json_logs_carry_the_same_fields() -> None:
    entry = json.loads(JsonFormatter().format(_record(**FIELDS)))
    assert {key: entry[key] for key in FIELDS} == FIELDS


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_configured_logging_writes_the_fields(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    from service.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", fmt)
        logging.getLogger("moe_control.test").info("stopped", extra={"event": "stopped"})
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    err = capsys.readouterr().err
    assert ('"event": "stopped"' if fmt == "json" else "event=stopped") in err, err
