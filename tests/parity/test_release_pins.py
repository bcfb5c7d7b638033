"""The release table against the installed release: the ruleset its version resolves to
carries that wheel's own torch and humming-kernels pins (its METADATA `Requires-Dist`)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from service.oracle import RULESETS, resolve_ruleset
from tests.parity.test_parity import _vllm_python

pytestmark = pytest.mark.parity

_PROBE = """
import json, importlib.metadata as m
from packaging.requirements import Requirement
pins = {}
for line in m.requires("vllm") or []:
    r = Requirement(line)
    if r.marker is None and r.name in ("torch", "humming-kernels"):
        pins[r.name] = str(r.specifier)
print(json.dumps({"version": m.version("vllm"), "pins": pins}))
"""


def test_the_installed_release_resolves_to_a_ruleset_with_its_pins() -> None:
    completed = subprocess.run(
        [str(_vllm_python()), "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    installed = json.loads(completed.stdout)
    release = RULESETS[resolve_ruleset(installed["version"])].release
    assert release.first == installed["version"]
    assert installed["pins"] == {
        "torch": f"=={release.torch}",
        "humming-kernels": f"=={release.humming_kernels}",
    }
