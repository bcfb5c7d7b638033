"""Which devices the server starts workers on.

'auto' asks a throwaway worker process (`python -m service.worker --list-devices`): torch
must not initialise CUDA in the server, whose later forks it would break, and the server
never imports torch at all.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import sys

#: The one device of a machine without a GPU (and a worker's default).
CPU = "cpu"
_DEVICE = re.compile(r"^(cpu|cuda:\d+|xpu:\d+)$")


async def discover_devices(spec: str, *, cpu_workers: int = 1, timeout: float = 120.0) -> list[str]:
    """The devices to start workers on: 'auto', 'cpu' or a comma-separated list; one worker
    each. Where that comes to the CPU alone ('cpu', or 'auto' without a GPU), `cpu_workers`
    CPU workers (more than one only to exercise the multi-worker paths without GPUs).

    'auto' asks a throwaway process; without torch installed it is the CPU at once.
    """
    devices = await _devices(spec.strip(), timeout)
    if devices == [CPU]:
        return [CPU] * max(1, cpu_workers)
    return devices


def torch_installed() -> bool:
    """Whether torch is importable here (looked up, not imported)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


async def _devices(spec: str, timeout: float) -> list[str]:
    if spec == "auto":
        if not torch_installed():
            return [CPU]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "service.worker",
            "--list-devices",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
        devices = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else []
        return [str(d) for d in devices] or [CPU]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in devices if not _DEVICE.match(d)]
    if bad or not devices:
        raise ValueError(f"devices: expected 'auto', 'cpu' or e.g. 'cuda:0,cuda:1'; got {spec!r}")
    return devices
