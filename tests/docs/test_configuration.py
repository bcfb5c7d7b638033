"""docs/configuration.md is exactly what `make docs` writes from the settings' own help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from service import settings_doc
from service.settings import Settings
from tests.docs.markdown import ROOT


def test_the_checked_in_page_matches_the_settings() -> None:
    checked_in = (ROOT / settings_doc.DOC_PATH).read_text()
    assert checked_in == settings_doc.render(), (
        "docs/configuration.md drifted from service/settings.py (run `make docs`)"
    )


def test_every_setting_has_a_row_with_its_flag_variable_and_help() -> None:
    page = settings_doc.render()
    for field in dataclasses.fields(Settings):
        (row,) = [line for line in page.splitlines() if line.startswith(f"| `{field.name}` |")]
        assert Settings.flag_name(field.name) in row
        assert Settings.env_name(field.name) in row
        assert field.metadata["help"].replace("|", "\\|") in row


def test_defaults_read_as_a_person_would_write_them() -> None:
    rows = {line.split(" | ")[0][3:-1]: line for line in settings_doc.render().splitlines()
            if line.startswith("| `")}  # fmt: skip
    assert "`16777216` (16 MiB)" in rows["max_receive_message_bytes"]
    assert "`17179869184` (16 GiB)" in rows["convert_max_layer_bytes"]
    assert "`--metrics-enabled`, `--no-metrics-enabled`" in rows["metrics_enabled"]
    assert "| unset |" in rows["tls_cert"]
    assert "| `10` |" in rows["grace_s"]


def test_main_writes_the_page_under_a_root(tmp_path: Path) -> None:
    assert settings_doc.main([str(tmp_path)]) == 0
    assert (tmp_path / settings_doc.DOC_PATH).read_text() == settings_doc.render()
