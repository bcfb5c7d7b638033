"""What a worker can see of its device: the platform profile vLLM's decision depends on.

torch is optional: the product's environment on CPU machines has none, and then the only
device is the CPU. GPU facts (capability, name, memory, ROCm arch) come from the real device
through torch, in the worker process that owns it.
"""

from __future__ import annotations

import importlib.util
import os
import platform as _platform
from pathlib import Path
from typing import Any

from service.oracle.platform import DECISION_ENV_FLAGS, KNOWN_PACKAGES

CPU = "cpu"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def installed_packages() -> list[str]:
    """The optional kernel packages vLLM probes for that are importable here."""
    return [name for name in KNOWN_PACKAGES if _has_module(name)]


def decision_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The VLLM_* flags that change the decision, as set in this process's environment."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in sorted(DECISION_ENV_FLAGS) if name in env}


def torch_available() -> bool:
    return _has_module("torch")


def visible_devices() -> list[str]:
    """Every device a worker could own: each visible GPU ('cuda:N', also for ROCm), each
    XPU ('xpu:N'), else the CPU. Imports torch when it is installed (call it in a throwaway
    process: initialising CUDA in the server would break later forks)."""
    if not torch_available():
        return [CPU]
    torch = _torch()
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return [f"xpu:{i}" for i in range(xpu.device_count())]
    return [CPU]


def _torch() -> Any:
    """torch, imported only where it is installed and needed (it is optional)."""
    return importlib.import_module("torch")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def probe(device: str) -> dict[str, Any]:
    """The worker's hello: its device facts and platform profile (PlatformProfile JSON)."""
    packages = installed_packages()
    env = decision_env()
    info: dict[str, Any] = {
        "device": device,
        "pid": os.getpid(),
        "torch_version": "",
        "device_name": "",
        "total_memory_bytes": 0,
    }
    kind, _, index_text = device.partition(":")
    if kind == CPU:
        flags = _cpu_flags()
        info["device_name"] = _cpu_name()
        info["platform"] = {
            "device": "cpu",
            "amx": "amx_tile" in flags and "amx_bf16" in flags,
            "x86": _platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"),
            "packages": packages,
            "env": env,
            "name": "cpu",
        }
        if torch_available():
            info["torch_version"] = str(_torch().__version__)
        return info

    torch = _torch()
    info["torch_version"] = str(torch.__version__)
    index = int(index_text or 0)
    if kind == "xpu":
        props = torch.xpu.get_device_properties(index)
        info["device_name"] = str(props.name)
        info["total_memory_bytes"] = int(props.total_memory)
        info["platform"] = {"device": "xpu", "packages": packages, "env": env, "name": props.name}
        return info
    torch.cuda.set_device(index)
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    is_rocm = getattr(torch.version, "hip", None) is not None
    profile: dict[str, Any] = {
        "device": "rocm" if is_rocm else "cuda",
        "capability": f"{major}.{minor}",
        "packages": packages,
        "env": env,
        "name": str(props.name),
    }
    if is_rocm:
        profile["arch"] = str(getattr(props, "gcnArchName", "")).split(":")[0] or None
    info["device_name"] = str(props.name)
    info["total_memory_bytes"] = int(props.total_memory)
    info["platform"] = profile
    return info
