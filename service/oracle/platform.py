"""Platform profiles: what vLLM's decision can see of a machine, and named GPU presets.

vLLM decides per machine from the device kind, the compute capability, which optional
kernel packages are importable, CPU features and a few environment flags. A profile captures
exactly those, so a decision can be computed for a GPU the caller does not have at hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from service.oracle.invalid import FieldViolation, InvalidSpecError

DEVICE_KINDS = ("cuda", "rocm", "xpu", "cpu")

#: Optional kernel packages that change vLLM's decision (import names as vLLM probes them;
#: "triton" is vLLM's `HAS_TRITON` on a CPU, i.e. triton-cpu, which vLLM 0.34 requires on x86).
KNOWN_PACKAGES = ("humming", "flashinfer", "zentorch", "triton")

#: What a stock `pip install vllm` brings: humming-kernels and flashinfer-python are among
#: its dependencies; they only matter on CUDA.
DEFAULT_CUDA_PACKAGES = frozenset({"humming", "flashinfer"})
#: What vLLM's CPU build brings on x86: triton-cpu (0.34 refuses to start on x86 without it).
DEFAULT_CPU_PACKAGES = frozenset({"triton"})

#: Environment flags that reach the WNA16 MoE decision in vLLM 0.33, with their meaning.
DECISION_ENV_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_USE_FLASHINFER_MOE_INT4": "enables FlashInfer TRT-LLM MxInt4 MoE on SM100",
        "VLLM_BATCH_INVARIANT": "requires batch-invariant kernels (rejects Marlin, FlashInfer)",
        "VLLM_HUMMING_MOE_GEMM_TYPE": "which humming MoE GEMM class is preferred",
        "VLLM_MARLIN_INPUT_DTYPE": "Marlin activation quantization (int8 / fp8; 0.34 removed it: "
        "setting it fails at start-up)",
        "VLLM_CPU_INT4_W4A8": "enables the zentorch DA8W4 MoE path on AMD Zen CPUs (default 1)",
    }
)
#: Environment flags no decision reads but a release refuses at start-up
#: (`Platform.validate_environ`, vLLM 0.34): a spec may set them, and a release that does not
#: look at them refuses them as it refuses any flag it does not read.
STARTUP_ENV_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_USE_V2_MODEL_RUNNER": "0.34: any value but 1 fails at start-up (Model Runner V1 "
        "was removed)",
    }
)
#: The flags vLLM parses with `bool(int(...))`: any other value makes vLLM fail at start-up.
INTEGER_ENV_FLAGS = frozenset(
    {"VLLM_USE_FLASHINFER_MOE_INT4", "VLLM_BATCH_INVARIANT", "VLLM_CPU_INT4_W4A8"}
)
#: pip distribution of each optional kernel package (import name -> what to install).
PACKAGE_DISTRIBUTIONS: Mapping[str, str] = MappingProxyType(
    {
        "humming": "humming-kernels",
        "flashinfer": "flashinfer-python",
        "zentorch": "zentorch",
        "triton": "triton-cpu",
    }
)


def parse_capability(value: object, *, field_name: str = "platform.capability") -> tuple[int, int]:
    """Parse "9.0", "90", 9.0, [9, 0] or (9, 0) into a (major, minor) pair: a major of 0 to
    99 and a minor of 0 to 9 (vLLM packs them as major * 10 + minor)."""
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
    ):
        return _bounded_capability(int(value[0]), int(value[1]), value, field_name)
    text = str(value).strip()
    if "." in text:
        major, _, minor = text.partition(".")
    elif text.isdigit() and len(text) >= 2:
        major, minor = text[:-1], text[-1]
    else:
        major, minor = "", ""
    if not (major.isdigit() and minor.isdigit()):
        raise InvalidSpecError.single(
            field_name, f"expected a compute capability like '9.0' or [9, 0], got {value!r}"
        )
    return _bounded_capability(int(major), int(minor), value, field_name)


def _bounded_capability(major: int, minor: int, value: object, field_name: str) -> tuple[int, int]:
    if not (0 <= major <= 99 and 0 <= minor <= 9):
        raise InvalidSpecError.single(
            field_name,
            f"expected a compute capability like '9.0' (major 0-99, minor 0-9), got {value!r}",
        )
    return major, minor


@dataclass(frozen=True, slots=True)
class PlatformProfile:
    """Everything of a machine that vLLM's WNA16 MoE decision depends on."""

    device: str
    capability: tuple[int, int] | None = None
    arch: str | None = None
    amx: bool = False
    x86: bool = True
    packages: frozenset[str] = field(default=frozenset())
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    name: str | None = None
    #: The preset this profile came from (possibly with packages or env overridden).
    preset: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.env, MappingProxyType):
            object.__setattr__(self, "env", MappingProxyType(dict(self.env)))

    @property
    def capability_int(self) -> int:
        """Capability as vLLM's `to_int()` gives it (9.0 -> 90); -1 when unknown."""
        if self.capability is None:
            return -1
        return self.capability[0] * 10 + self.capability[1]

    def has_package(self, name: str) -> bool:
        return name in self.packages

    def env_flag(self, name: str, default: str | None = None) -> str | None:
        return self.env.get(name, default)

    def with_overrides(
        self,
        *,
        packages: frozenset[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> PlatformProfile:
        merged_env = dict(self.env) if env is None else {**self.env, **env}
        return replace(
            self,
            packages=self.packages if packages is None else packages,
            env=MappingProxyType(merged_env),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "capability": (
                None if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"
            ),
            "arch": self.arch,
            "amx": self.amx,
            "x86": self.x86,
            "packages": sorted(self.packages),
            "env": dict(sorted(self.env.items())),
            "name": self.name,
            "preset": self.preset,
        }

    @classmethod
    def from_json(
        cls, obj: Mapping[str, Any], *, field_prefix: str = "platform"
    ) -> PlatformProfile:
        """Build a profile from its JSON form; unknown keys and bad values are domain errors."""
        allowed = {
            "device",
            "capability",
            "arch",
            "amx",
            "x86",
            "packages",
            "env",
            "name",
            "preset",
        }
        violations = [
            FieldViolation(f"{field_prefix}.{key}", f"unknown field; allowed: {sorted(allowed)}")
            for key in obj
            if key not in allowed
        ]
        device = obj.get("device")
        if device not in DEVICE_KINDS:
            violations.append(
                FieldViolation(
                    f"{field_prefix}.device", f"must be one of {list(DEVICE_KINDS)}, got {device!r}"
                )
            )
        packages_raw = obj.get("packages")
        if packages_raw is None:
            packages = {"cuda": DEFAULT_CUDA_PACKAGES, "cpu": DEFAULT_CPU_PACKAGES}.get(
                str(device), frozenset()
            )
        elif isinstance(packages_raw, list | tuple | set | frozenset) and all(
            isinstance(p, str) for p in packages_raw
        ):
            packages = frozenset(packages_raw)
            unknown = sorted(packages - set(KNOWN_PACKAGES))
            if unknown:
                violations.append(
                    FieldViolation(
                        f"{field_prefix}.packages",
                        f"unknown packages {unknown}; allowed: {list(KNOWN_PACKAGES)}",
                    )
                )
        else:
            packages = frozenset()
            violations.append(
                FieldViolation(f"{field_prefix}.packages", "must be a list of package names")
            )
        env_raw = obj.get("env") or {}
        if not isinstance(env_raw, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | bool) for k, v in env_raw.items()
        ):
            violations.append(
                FieldViolation(f"{field_prefix}.env", "must map VLLM_* names to string values")
            )
            env_raw = {}
        env = {k: _env_value(v) for k, v in env_raw.items()}
        violations.extend(_env_violations(env, f"{field_prefix}.env"))
        capability = None
        if obj.get("capability") is not None:
            try:
                capability = parse_capability(
                    obj["capability"], field_name=f"{field_prefix}.capability"
                )
            except InvalidSpecError as exc:
                violations.extend(exc.violations)
        elif device in ("cuda", "rocm"):
            violations.append(
                FieldViolation(
                    f"{field_prefix}.capability", f"required for device {device!r}, e.g. '9.0'"
                )
            )
        for flag in ("amx", "x86"):
            if flag in obj and not isinstance(obj[flag], bool):
                violations.append(FieldViolation(f"{field_prefix}.{flag}", "must be a boolean"))
        if violations:
            raise InvalidSpecError(violations)
        return cls(
            device=str(device),
            capability=capability,
            arch=obj.get("arch"),
            amx=bool(obj.get("amx", False)),
            x86=bool(obj.get("x86", True)),
            packages=packages,
            env=MappingProxyType(env),
            name=obj.get("name"),
            preset=obj.get("preset"),
        )


def _env_violations(env: Mapping[str, str], prefix: str) -> list[FieldViolation]:
    """A flag vLLM does not read for this decision, or an integer flag that is no integer,
    is refused (silently accepting it would answer as if it mattered)."""
    found = []
    known = {*DECISION_ENV_FLAGS, *STARTUP_ENV_FLAGS}
    for name, value in env.items():
        if name not in known:
            found.append(
                FieldViolation(
                    f"{prefix}.{name}",
                    "not an environment flag vLLM reads for the WNA16 MoE decision or at "
                    f"start-up; the flags it reads: {sorted(known)}",
                )
            )
        elif name in INTEGER_ENV_FLAGS and not value.strip().lstrip("-").isdigit():
            found.append(
                FieldViolation(
                    f"{prefix}.{name}", f"vLLM reads it as an integer (0 or 1), got {value!r}"
                )
            )
    return found


def _env_value(value: str | int | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _cuda(name: str, major: int, minor: int) -> PlatformProfile:
    return PlatformProfile(
        device="cuda",
        capability=(major, minor),
        packages=DEFAULT_CUDA_PACKAGES,
        name=name,
        preset=name,
    )


def _rocm(name: str, arch: str, major: int, minor: int) -> PlatformProfile:
    return PlatformProfile(
        device="rocm", capability=(major, minor), arch=arch, name=name, preset=name
    )


#: Named presets, so `--gpu h100` answers without the device at hand.
#:
#: The packages convention: a CUDA preset is a machine with a stock `pip install vllm`, so it
#: has vLLM's CUDA kernel dependencies (`DEFAULT_CUDA_PACKAGES`: humming and flashinfer); a
#: CPU preset is an x86 machine with vLLM's CPU build, so it has triton-cpu
#: (`DEFAULT_CPU_PACKAGES`); a ROCm or XPU preset has none of the optional packages (vLLM's
#: ROCm and XPU builds do not bring them). `--packages` (or a spec's "packages") overrides
#: either.
#:
#: Capabilities of the added presets, from NVIDIA's CUDA GPU list
#: (https://developer.nvidia.com/cuda-gpus): GeForce RTX 4090 8.9, GeForce RTX 3090 8.6,
#: RTX A6000 8.6, L40 8.9; H20 is a Hopper part and Hopper is compute capability 9.0
#: (NVIDIA's Hopper tuning guide, https://docs.nvidia.com/cuda/hopper-tuning-guide/). MI250X's
#: LLVM target is gfx90a (AMD's ROCm "GPU hardware specifications" table,
#: https://rocm.docs.amd.com/en/latest/reference/gpu-arch-specs.html); HIP reports gfx90a as
#: capability 9.0, as it reports gfx942 as 9.4.
PLATFORM_PRESETS: Mapping[str, PlatformProfile] = MappingProxyType(
    {
        "v100": _cuda("v100", 7, 0),
        "t4": _cuda("t4", 7, 5),
        "a10": _cuda("a10", 8, 6),
        "a100": _cuda("a100", 8, 0),
        "l4": _cuda("l4", 8, 9),
        "l40": _cuda("l40", 8, 9),
        "l40s": _cuda("l40s", 8, 9),
        "rtx3090": _cuda("rtx3090", 8, 6),
        "rtxa6000": _cuda("rtxa6000", 8, 6),
        "rtx4090": _cuda("rtx4090", 8, 9),
        "h100": _cuda("h100", 9, 0),
        "h200": _cuda("h200", 9, 0),
        "h20": _cuda("h20", 9, 0),
        "gh200": _cuda("gh200", 9, 0),
        "b200": _cuda("b200", 10, 0),
        "gb200": _cuda("gb200", 10, 0),
        "b300": _cuda("b300", 10, 3),
        "rtx5090": _cuda("rtx5090", 12, 0),
        "gb10": _cuda("gb10", 12, 1),
        "mi250x": _rocm("mi250x", "gfx90a", 9, 0),
        "mi300x": _rocm("mi300x", "gfx942", 9, 4),
        "mi355x": _rocm("mi355x", "gfx950", 9, 5),
        "gfx1100": _rocm("gfx1100", "gfx1100", 11, 0),
        "gfx1201": _rocm("gfx1201", "gfx1201", 12, 0),
        "xpu": PlatformProfile(device="xpu", name="xpu", preset="xpu"),
        "cpu": PlatformProfile(
            device="cpu", amx=True, packages=DEFAULT_CPU_PACKAGES, name="cpu", preset="cpu"
        ),
        "cpu-noamx": PlatformProfile(
            device="cpu",
            amx=False,
            packages=DEFAULT_CPU_PACKAGES,
            name="cpu-noamx",
            preset="cpu-noamx",
        ),
    }
)

#: Spellings users type for the same preset.
_PRESET_ALIASES = {
    "rtx-5090": "rtx5090",
    "5090": "rtx5090",
    "mi300": "mi300x",
    "rtx-4090": "rtx4090",
    "4090": "rtx4090",
    "rtx-3090": "rtx3090",
    "3090": "rtx3090",
    "rtx-a6000": "rtxa6000",
    "a6000": "rtxa6000",
    "mi250": "mi250x",
}


def preset(name: str, *, field_name: str = "platform") -> PlatformProfile:
    """Look a preset up by name (case-insensitive); unknown names list the known ones."""
    key = name.strip().lower()
    key = _PRESET_ALIASES.get(key, key)
    try:
        return PLATFORM_PRESETS[key]
    except KeyError:
        raise InvalidSpecError.single(
            field_name, f"unknown platform preset {name!r}; known: {sorted(PLATFORM_PRESETS)}"
        ) from None
