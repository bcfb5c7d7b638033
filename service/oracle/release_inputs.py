"""What a chosen release does not accept of a valid spec: a domain error on the field.

The spec parser accepts what any release the oracle answers as accepts; an older release may
lack a flag (an environment flag it never reads) or refuse a value in its own configuration
checks (expert load balancing on a device its `ParallelConfig` rejects). Answering as if the
flag mattered, dropping it silently, or copying the text of a pydantic error whose wording
depends on every other argument `vllm serve` was given would all mislead, so each is a field
violation naming the field and what that release accepts.
"""

from __future__ import annotations

from service.oracle.errors import FieldViolation, InvalidSpecError
from service.oracle.rulesets.base import Ruleset
from service.oracle.spec import DeploymentSpec

#: How vLLM's messages name the device kinds.
_DEVICE_NAMES = {"cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "cpu": "CPU"}


def unaccepted(spec: DeploymentSpec, ruleset: Ruleset) -> list[FieldViolation]:
    """Every field of `spec` that `ruleset`'s release does not accept, with why."""
    found = [
        FieldViolation(
            f"platform.env.{name}",
            f"{ruleset.name} does not read this flag for the WNA16 MoE decision (other "
            f"releases do); the flags it reads: {sorted(ruleset.env_flags)}",
        )
        for name in spec.platform.env
        if name not in ruleset.env_flags
    ]
    if spec.parallel.enable_eplb and spec.platform.device not in ruleset.eplb_devices:
        devices = ", ".join(sorted(_DEVICE_NAMES[d] for d in ruleset.eplb_devices))
        found.append(
            FieldViolation(
                "parallel.enable_eplb",
                f"{ruleset.name} supports expert load balancing only on {devices} devices "
                f"(its ParallelConfig refuses it on {_DEVICE_NAMES[spec.platform.device]})",
            )
        )
    return found


def refuse_unaccepted(spec: DeploymentSpec, ruleset: Ruleset) -> None:
    """Raise `InvalidSpecError` listing `unaccepted(spec, ruleset)`, if any."""
    violations = unaccepted(spec, ruleset)
    if violations:
        raise InvalidSpecError(violations)
