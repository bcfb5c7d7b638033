#!/usr/bin/env python
"""Run vLLM 0.33.0's own weight conversions on cases prepared by the product-side tests.

Usage (in the vLLM environment, e.g. ``/tmp/vllmvenv/bin/python``)::

    python tests/formats/vllm_checker.py CASE_DIR

``CASE_DIR/cases.json`` lists ``{"id": ..., "case": <registered name>, "spec": {...}}``;
each case's input tensors are in ``CASE_DIR/<id>.in.safetensors``. For each case the
checker calls the function registered under ``case`` in the `vllm_cases` package (see its
docstring for how to add families), writes the tensors it returns to
``CASE_DIR/<id>.out.safetensors`` and a summary to ``CASE_DIR/results.json``::

    {"<id>": {"ok": true, "none": ["w13_bias", ...], "meta": {...}},
     "<id>": {"ok": false, "error_type": "ValueError", "error": "<message>"}}

Only safetensors and JSON cross the process boundary (no pickle). vLLM is imported once, so
hundreds of cases cost one start-up (about 15 s).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(__doc__ or "")
        return 2
    case_dir = Path(argv[1])
    sys.path.insert(0, str(HERE))
    from safetensors.torch import load_file, save_file
    from vllm_cases import load_all

    table = load_all()
    results: dict[str, dict[str, object]] = {}
    for entry in json.loads((case_dir / "cases.json").read_text()):
        case_id = entry["id"]
        source = case_dir / f"{case_id}.in.safetensors"
        inputs = load_file(str(source)) if source.exists() else {}
        try:
            function = table[entry["case"]]
            outputs, meta = function(entry["spec"], inputs)
        except Exception as error:  # vLLM refusing a case is a result, not a crash
            results[case_id] = {
                "ok": False,
                "error_type": type(error).__name__,
                "error": str(error),
                "where": traceback.format_exc(limit=-2),
            }
            continue
        present = {n: t.detach().contiguous().clone() for n, t in outputs.items() if t is not None}
        save_file(present, str(case_dir / f"{case_id}.out.safetensors"))
        none = sorted(n for n, t in outputs.items() if t is None)
        results[case_id] = {"ok": True, "none": none, "meta": meta}
    (case_dir / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
