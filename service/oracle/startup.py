"""What a vLLM release refuses while it builds its engine configuration, before any layer.

Two checks run on every `vllm serve` whatever the model: `Platform.validate_environ`, which
`EngineArgs.create_engine_config` calls before it builds the model config (stage
`environment`: a variable the release removed or retired), and the platform's
`check_and_update_config`, which `VllmConfig` runs as it is constructed, after the
quantization config and the parallel config are built (stage `platform`: a machine the
release will not run on). A release's refusals are rows (`StartupRules`, carried by its
ruleset), so a release that adds or drops one is a changed table, not a new branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.oracle.errors import ErrorInfo, SelectionError
from service.oracle.platform import PlatformProfile


@dataclass(frozen=True, slots=True)
class EnvironmentRule:
    """One variable `validate_environ` refuses: `refuses(value)` says when, `message(value)`
    is vLLM's text (a `ValueError`)."""

    name: str
    refuses: Callable[[str], bool]
    message: Callable[[str], str]


@dataclass(frozen=True, slots=True)
class PlatformRule:
    """One refusal of the platform's `check_and_update_config`: when it `applies` to the
    machine, vLLM raises `type` with `message`."""

    applies: Callable[[PlatformProfile], bool]
    type: str
    message: str


@dataclass(frozen=True, slots=True)
class StartupRules:
    """A release's start-up refusals; none by default (0.33 and older only warn)."""

    environment: tuple[EnvironmentRule, ...] = ()
    platform: tuple[PlatformRule, ...] = ()

    @property
    def environment_flags(self) -> frozenset[str]:
        """The variables these rules read."""
        return frozenset(rule.name for rule in self.environment)


def environment_refusal(rules: StartupRules, platform: PlatformProfile) -> SelectionError | None:
    """vLLM's error for the first refused variable of `platform.env`, else None.

    vLLM walks `os.environ` in the process's own order; a spec's variables have none, so
    they are walked by name (the order the reference harness sets them in)."""
    by_name = {rule.name: rule for rule in rules.environment}
    for name in sorted(platform.env):
        rule = by_name.get(name)
        value = platform.env[name]
        if rule is not None and rule.refuses(value):
            return SelectionError(ErrorInfo("environment", "ValueError", rule.message(value)))
    return None


def platform_refusal(
    rules: StartupRules, platform: PlatformProfile, quantization: str
) -> SelectionError | None:
    """vLLM's error where `check_and_update_config` refuses this machine, else None."""
    for rule in rules.platform:
        if rule.applies(platform):
            return SelectionError(
                ErrorInfo("platform", rule.type, rule.message), quantization=quantization
            )
    return None
