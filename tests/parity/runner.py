"""Running vLLM's reference harness over specs: the one path the live test and the recorder share.

The harness (`vllm_reference.py`) runs in a release's own environment, as a subprocess, so
the product's environment never imports vLLM; the recorder writes what this returns and the
live test compares what this returns with the record, which is what proves the record.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REFERENCE = Path(__file__).resolve().with_name("vllm_reference.py")

#: The whole grid takes minutes on one core; a run past this is stuck, not slow.
TIMEOUT_S = 1800


class ReferenceRunError(RuntimeError):
    """The harness did not answer every spec (it exited non-zero or lost lines)."""


def _clean_env() -> dict[str, str]:
    # The release's environment must see its own packages only, never this checkout's.
    return {**os.environ, "PYTHONPATH": ""}


def run_reference(python: Path, specs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's answers to `specs`, in order, from the harness run by `python`."""
    completed = subprocess.run(
        [str(python), str(REFERENCE)],
        input="".join(json.dumps(spec) + "\n" for spec in specs),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env=_clean_env(),
    )
    if completed.returncode != 0:
        raise ReferenceRunError(
            f"{python} {REFERENCE.name} exited {completed.returncode}:\n{completed.stderr[-4000:]}"
        )
    answers = [json.loads(line) for line in completed.stdout.splitlines() if line.strip()]
    if len(answers) != len(specs):
        raise ReferenceRunError(f"{len(answers)} answers for {len(specs)} specs")
    for spec, answer in zip(specs, answers, strict=True):
        if answer.get("id") != spec["id"]:
            raise ReferenceRunError(f"answer {answer.get('id')!r} in the place of {spec['id']!r}")
    return answers


def vllm_version(python: Path) -> str:
    """`vllm.__version__` as the environment behind `python` reports it."""
    completed = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**_clean_env(), "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    if completed.returncode != 0:
        raise ReferenceRunError(f"{python} cannot import vllm:\n{completed.stderr[-2000:]}")
    return completed.stdout.strip().splitlines()[-1]
