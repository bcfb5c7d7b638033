"""Record one vLLM release's own conversions of the exactness grid (part of `make parity-record`).

    python -m tests.formats.record_conversions --python .venv-vllm/bin/python --release 0.33.0

builds the grid's synthetic checkpoints, runs that release's loaders and
`process_weights_after_loading` over them (`vllm_checker.py`, case ``wna16_convert``, or
``marlin_integration`` for MARLIN, with the CUDA-only repack replaced by its reference) and
writes `tests/formats/records/vllm-X.Y.conversions.jsonl.gz` (see `conversion_records`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import load_file

from tests.formats.conversion_records import (
    RECORDS_DIR,
    ConversionRecord,
    cases_hash,
    outcome,
    record_path,
    to_bytes,
)
from tests.formats.exactness_run import CASES, prepare, run_checker
from tests.parity.records import ruleset_for
from tests.parity.runner import vllm_version


def record(python: Path, version: str) -> ConversionRecord:
    """Run the release at `python` over every case and digest what it produced."""
    with tempfile.TemporaryDirectory(prefix="conversion-record-") as scratch:
        directory = Path(scratch)
        inputs = prepare(directory)
        results = run_checker(python, directory)
        lines = []
        for case in CASES:
            result = results[case.id]
            produced = directory / f"{case.id}.out.safetensors"
            outputs = load_file(str(produced)) if result["ok"] else {}
            lines.append(outcome(case, result, outputs))
    return ConversionRecord(ruleset_for(version), version, cases_hash(CASES, inputs), tuple(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--python", type=Path, required=True, help="the release's venv python")
    parser.add_argument("--release", required=True, help="the vLLM version expected there")
    parser.add_argument("--out", type=Path, default=RECORDS_DIR, help="records directory")
    args = parser.parse_args(argv)
    version = vllm_version(args.python)
    if version != args.release:
        parser.error(f"{args.python} has vLLM {version}, not {args.release}")
    fresh = record(args.python, version)
    path = record_path(fresh.ruleset, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_bytes(to_bytes(fresh))
    converted = sum(line["ok"] for line in fresh.outcomes)
    sys.stderr.write(
        f"{path}: {len(fresh.outcomes)} cases from vLLM {version} ({converted} converted), "
        f"{path.stat().st_size} bytes\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
