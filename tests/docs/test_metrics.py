"""docs/metrics.md lists every metric service/metrics.py declares, with its type and labels."""

from __future__ import annotations

from service.metrics import Metrics
from tests.deploy.checks import family, service_metrics
from tests.docs.markdown import ROOT

PAGE = ROOT / "docs" / "metrics.md"


def documented_rows() -> dict[str, list[str]]:
    """The reference table: metric name -> its cells (type, labels, meaning)."""
    section = PAGE.read_text().split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def declared() -> dict[str, tuple[str, frozenset[str]]]:
    """Each domain and gRPC metric: its exposed name (counters end in _total), type, labels."""
    labels = {family(name): names for name, names in service_metrics().items()}
    found = {}
    for metric in Metrics().registry.collect():
        if metric.name.startswith(("process_", "python_")):
            continue
        name = metric.name + "_total" if metric.type == "counter" else metric.name
        found[name] = (metric.type, labels[metric.name])
    return found


def test_every_metric_is_in_the_reference_with_its_type_and_labels() -> None:
    rows = documented_rows()
    assert len(declared()) >= 15
    for name, (kind, labels) in declared().items():
        assert name in rows, f"docs/metrics.md lacks {name}"
        row_kind, row_labels, _ = rows[name]
        assert row_kind == kind, name
        assert {part.strip("` ") for part in row_labels.split(",") if part.strip()} == labels, name


def test_the_reference_lists_no_metric_the_server_lacks() -> None:
    extra = set(documented_rows()) - set(declared())
    assert not extra, (
        f"docs/metrics.md documents metrics service/metrics.py does not declare: {extra}"
    )
