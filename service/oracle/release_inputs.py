"""What a chosen release does not accept of a valid spec: a domain error on the field.

The spec parser accepts what any release the oracle answers as accepts; an older release may
lack a flag (an environment flag it never reads) or a value (an `--all2all-backend` its
`ParallelConfig` does not list). Answering as if the flag mattered or
dropping it silently would both mislead, so each is a field violation naming the field and
the flags that release reads. (A value a release's own configuration checks refuse, such as
expert load balancing on a device its `ParallelConfig` rejects, is vLLM's own answer:
`service.oracle.parallel_config`.)
"""

from __future__ import annotations

from service.oracle.errors import FieldViolation, InvalidSpecError
from service.oracle.rulesets.base import Ruleset
from service.oracle.spec import DeploymentSpec


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
    backend = spec.parallel.all2all_backend
    if backend not in ruleset.all2all_backends:
        found.append(
            FieldViolation(
                "parallel.all2all_backend",
                f"{ruleset.name} has no all2all backend {backend!r} (other releases do); "
                f"it accepts: {list(ruleset.all2all_backends)}",
            )
        )
    return found


def refuse_unaccepted(spec: DeploymentSpec, ruleset: Ruleset) -> None:
    """Raise `InvalidSpecError` listing `unaccepted(spec, ruleset)`, if any."""
    violations = unaccepted(spec, ruleset)
    if violations:
        raise InvalidSpecError(violations)
