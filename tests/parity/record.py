"""Record one vLLM release's answers to the parity grid: `make parity-record VLLM=X.Y.Z`.

    python -m tests.parity.record --python .venv-vllm/bin/python --release 0.33.0

runs the reference harness in that release's environment over the generated grid and
writes `tests/parity/records/vllm-X.Y.jsonl.gz` (see `records`). The release is the one
the environment reports (`vllm.__version__`); `--release` only guards against recording
from the wrong environment. Re-recording an unchanged grid and release rewrites the
same bytes: the original date is kept when nothing else differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.parity.grid import generate
from tests.parity.records import (
    RECORDS_DIR,
    Record,
    file_hash,
    grid_hash,
    load,
    record_path,
    ruleset_for,
    to_bytes,
)
from tests.parity.runner import REFERENCE, run_reference, vllm_version


def today() -> str:
    """The recording day (UTC), or SOURCE_DATE_EPOCH's day where a build pins the clock."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.UTC)
        if epoch
        else datetime.datetime.now(datetime.UTC)
    )
    return moment.date().isoformat()


def settle_date(fresh: Record, path: Path) -> Record:
    """`fresh`, dated as the existing record at `path` where the answers are the same."""
    if not path.exists():
        return fresh
    try:
        previous = load(path)
    except (OSError, ValueError, KeyError):
        return fresh
    if previous.same_answers(fresh):
        return dataclasses.replace(fresh, date=previous.date)
    return fresh


def write(record: Record, directory: Path = RECORDS_DIR) -> Path:
    """Write `record` (keeping an unchanged record's date); return its path."""
    path = record_path(record.ruleset, directory)
    settled = settle_date(record, path)
    directory.mkdir(parents=True, exist_ok=True)
    path.write_bytes(to_bytes(settled))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", type=Path, required=True, help="the release's venv python")
    parser.add_argument("--release", required=True, help="the vLLM version expected there")
    parser.add_argument("--out", type=Path, default=RECORDS_DIR, help="records directory")
    args = parser.parse_args(argv)
    version = vllm_version(args.python)
    if version != args.release:
        parser.error(f"{args.python} has vLLM {version}, not {args.release}")
    specs = generate()
    answers = run_reference(args.python, specs)
    record = Record(
        ruleset=ruleset_for(version),
        vllm_version=version,
        grid_sha256=grid_hash(specs),
        harness_sha256=file_hash(REFERENCE),
        date=today(),
        answers=tuple(answers),
    )
    path = write(record, args.out)
    errors = sum("harness_error" in answer for answer in answers)
    sys.stderr.write(
        f"{path}: {len(answers)} answers from vLLM {version} "
        f"({errors} harness errors), {path.stat().st_size} bytes\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
