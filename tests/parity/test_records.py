"""Every ruleset against its checked-in record of vLLM's answers, with no vLLM installed.

Each `records/vllm-X.Y.jsonl.gz` holds one release's answers to the whole grid, recorded
from that release's own code (`make parity-record VLLM=X.Y.Z`); here the ruleset of that
release answers every scenario and each field must agree. A record made from another grid
fails with the command that regenerates it. The rest checks the record format itself:
reproducible bytes, the kept date, stale-grid detection and that a changed answer is caught.
"""

from __future__ import annotations

import dataclasses
import gzip
import sys
from pathlib import Path

import pytest

from service.oracle import DEFAULT_RULESET, RULESETS
from tests.parity.compare import differences, ours
from tests.parity.grid import generate
from tests.parity.record import settle_date, write
from tests.parity.records import (
    Record,
    from_bytes,
    grid_hash,
    load,
    record_path,
    recorded_rulesets,
    ruleset_for,
    to_bytes,
)

#: Rulesets that exist but whose release has no record yet (its environment was never built).
#: Listing one is a decision; a new ruleset without a record, or a recorded one still here, fails.
AWAITING_RECORD: frozenset[str] = frozenset({"vllm-0.30", "vllm-0.31"})


@pytest.fixture(scope="module")
def specs() -> list[dict]:
    return generate()


def test_every_ruleset_has_a_record_or_is_listed_as_awaiting_one() -> None:
    missing = set(RULESETS) - set(recorded_rulesets())
    assert missing == AWAITING_RECORD, (
        f"rulesets without a record: {sorted(missing)}; listed as awaiting one: "
        f"{sorted(AWAITING_RECORD)} (record a release with `make parity-record VLLM=X.Y.Z`)"
    )


def test_the_default_ruleset_has_a_record() -> None:
    # The live test checks vLLM against this record; without it the recording path is unproven.
    assert DEFAULT_RULESET in recorded_rulesets()


@pytest.mark.parametrize("ruleset", recorded_rulesets())
def test_ruleset_matches_its_record(ruleset: str, specs: list[dict]) -> None:
    record = load(record_path(ruleset))
    assert ruleset in RULESETS, f"a record for {ruleset}, but no such ruleset: {sorted(RULESETS)}"
    stale = record.stale_for(specs)
    assert stale is None, stale
    failures: list[str] = []
    for spec, expected in zip(specs, record.answers, strict=True):
        assert expected["id"] == spec["id"]
        diffs = differences(expected, ours(spec, ruleset))
        if diffs:
            failures.append(f"{spec['id']}: " + "; ".join(diffs))
    passed = len(specs) - len(failures)
    sys.stderr.write(
        f"\nparity record: {ruleset} {passed} of {len(specs)} scenarios identical to "
        f"vLLM {record.vllm_version} (recorded {record.date})\n"
    )
    assert not failures, f"{len(failures)} of {len(specs)} differ:\n" + "\n".join(failures[:30])


def _small(date: str = "2026-01-01", backend: str = "MARLIN") -> Record:
    specs = generate()[:3]
    answers = tuple({"id": s["id"], "backend": backend, "candidates": []} for s in specs)
    return Record("vllm-0.33", "0.33.0", grid_hash(specs), "0" * 64, date, answers)


def test_the_same_record_gives_the_same_bytes(tmp_path: Path) -> None:
    data = to_bytes(_small())
    assert data == to_bytes(_small())
    assert data[4:8] == b"\0\0\0\0", "gzip mtime must be fixed"
    assert from_bytes(data) == _small()
    first = write(_small(), tmp_path).read_bytes()
    assert write(_small(), tmp_path).read_bytes() == first


def test_an_unchanged_rerecord_keeps_its_date_and_a_changed_one_does_not(tmp_path: Path) -> None:
    path = write(_small(date="2026-01-01"), tmp_path)
    assert settle_date(_small(date="2026-02-02"), path).date == "2026-01-01"
    assert settle_date(_small(date="2026-02-02", backend="TRITON"), path).date == "2026-02-02"


def test_a_changed_grid_names_the_command_that_regenerates_the_record() -> None:
    record = _small()
    specs = generate()[:3]
    assert record.stale_for(specs) is None
    changed = [{**specs[0], "moe_backend": "triton"}, *specs[1:]]
    message = record.stale_for(changed)
    assert message is not None
    assert "make parity-record VLLM=0.33.0" in message


def test_a_changed_answer_in_the_record_is_caught(specs: list[dict]) -> None:
    record = load(record_path(DEFAULT_RULESET))
    index = next(i for i, a in enumerate(record.answers) if a.get("backend"))
    tampered = {**record.answers[index], "backend": "NOT_A_BACKEND"}
    assert differences(record.answers[index], ours(specs[index])) == []
    assert any(d.startswith("backend:") for d in differences(tampered, ours(specs[index])))


def test_a_truncated_record_is_refused() -> None:
    record = _small()
    cut = dataclasses.replace(record, answers=record.answers[:-1])
    lines = gzip.decompress(to_bytes(cut)).splitlines()
    header = lines[0].replace(b'"scenarios":2', b'"scenarios":3')
    with pytest.raises(ValueError, match="3 scenarios"):
        from_bytes(gzip.compress(b"\n".join([header, *lines[1:]])))


@pytest.mark.parametrize(
    ("version", "ruleset"),
    [("0.33.0", "vllm-0.33"), ("0.27.1", "vllm-0.27"), ("v0.30.0", "vllm-0.30")],
)
def test_a_release_answers_as_its_minor_ruleset(version: str, ruleset: str) -> None:
    assert ruleset_for(version) == ruleset


def test_a_record_under_another_release_s_name_is_refused(tmp_path: Path) -> None:
    wrong = dataclasses.replace(_small(), vllm_version="0.30.0")
    path = record_path("vllm-0.33", tmp_path)
    path.write_bytes(to_bytes(wrong))
    with pytest.raises(ValueError, match=r"vLLM 0\.30\.0 is not vllm-0\.33"):
        load(path)
