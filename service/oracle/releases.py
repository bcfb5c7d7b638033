"""The vLLM releases the oracle answers as, by ruleset name, and the one resolver that turns
what a user writes ("vllm-0.33", "0.33", "0.33.0", "v0.33.0") into a ruleset's name.

Every place a ruleset name enters (the deployment spec's `ruleset`, the request field, the
CLI's `--ruleset`) goes through `resolve_ruleset`, so they all accept the same forms and
refuse an unknown one with the same error, which lists the known ones. This table imports
nothing of the oracle, so the spec parser can resolve a name without importing the
rulesets (which are built from the parsed configs); each ruleset carries its row as
`Ruleset.release`, and the registry (`service.oracle.rulesets`) checks that every row has
its ruleset and every ruleset its row.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from service.oracle.invalid import UnknownRulesetError


def version_tuple(text: str) -> tuple[int, ...] | None:
    """A release number's parts ("0.33.1" -> (0, 33, 1)); None when `text` is not one."""
    parts = text.split(".")
    if not all(part.isdigit() and part.isascii() for part in parts):
        return None
    return tuple(int(part) for part in parts)


def release_range(first: str, below: str) -> str:
    """The range from `first` up to `below` (exclusive), as a pip requirement writes it."""
    return f">={first},<{below}"


@dataclass(frozen=True, slots=True)
class Release:
    """Which vLLM releases a ruleset (`name`) answers for, and what those releases pin.

    `first` is the release whose source the ruleset reproduces and `below` the first one
    it does not answer for (exclusive). A patch release inside the range is taken to carry
    its series' rules (0.27.1's selection code is 0.27.0's, byte for byte), so a pod
    reporting it resolves here; a patch that changes the rules gets a ruleset of its own
    and narrows this range. The pins are the `Requires-Dist` of `first`'s wheel.
    """

    name: str
    first: str
    below: str
    #: `Requires-Dist: torch==...`: the torch build the release's kernels were built for.
    torch: str
    #: `Requires-Dist: humming-kernels[cu13]==...`: what HUMMING's checks were written for.
    humming_kernels: str

    def __post_init__(self) -> None:
        first, below = version_tuple(self.first), version_tuple(self.below)
        if first is None or below is None or not first < below:
            raise ValueError(f"bad release range {self.first!r} .. <{self.below!r}")

    @property
    def series(self) -> str:
        """The minor series ("0.33"), the short name a user types."""
        return ".".join(self.first.split(".")[:2])

    @property
    def range_text(self) -> str:
        return release_range(self.first, self.below)

    def contains(self, version: tuple[int, ...]) -> bool:
        """Whether a full release number (major.minor.patch) falls inside the range."""
        first, below = version_tuple(self.first), version_tuple(self.below)
        assert first is not None and below is not None
        return first <= version < below


#: One row per ruleset, oldest release first. The pins are the release wheel's
#: `Requires-Dist: torch==` and `humming-kernels[cu13]==`.
RELEASES: Mapping[str, Release] = MappingProxyType(
    {
        r.name: r
        for r in (
            Release(
                "vllm-0.27", first="0.27.0", below="0.28", torch="2.13.0", humming_kernels="0.1.10"
            ),
            Release(
                "vllm-0.28", first="0.28.0", below="0.29", torch="2.13.0", humming_kernels="0.1.12"
            ),
            Release(
                "vllm-0.29", first="0.29.0", below="0.30", torch="2.13.0", humming_kernels="0.1.12"
            ),
            Release(
                "vllm-0.30", first="0.30.0", below="0.31", torch="2.13.0", humming_kernels="0.1.12"
            ),
            Release(
                "vllm-0.31", first="0.31.0", below="0.32", torch="2.13.0", humming_kernels="0.1.16"
            ),
            Release(
                "vllm-0.32", first="0.32.0", below="0.33", torch="2.13.0", humming_kernels="0.1.17"
            ),
            Release(
                "vllm-0.33", first="0.33.0", below="0.34", torch="2.14.0", humming_kernels="0.1.19"
            ),
            Release(
                "vllm-0.34", first="0.34.0", below="0.35", torch="2.14.0", humming_kernels="0.1.19"
            ),
        )
    }
)
#: The newest release's ruleset: what a request that names none is decided by.
DEFAULT_RULESET: str = list(RELEASES)[-1]

#: Prefixes a release may be written with ("vllm-0.33", "vllm==0.33.0", "v0.33.0").
_PREFIXES = ("vllm==", "vllm-", "v")


def _release_number(text: str) -> tuple[int, ...] | None:
    """The release number a name spells, without its prefix or local label ("+cu129")."""
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text.removeprefix(prefix)
            break
    return version_tuple(text.removeprefix("v").split("+", 1)[0])


def _lookup(text: str) -> Release | None:
    key = text.strip().lower()
    if key in RELEASES:
        return RELEASES[key]
    number = _release_number(key)
    if number is None:
        return None
    for release in RELEASES.values():
        if len(number) == 2 and ".".join(map(str, number)) == release.series:
            return release
        if len(number) == 3 and release.contains(number):
            return release
    return None


def resolve_ruleset(name: str, *, field: str = "ruleset") -> str:
    """The name of the ruleset `name` means; blank means the default (the newest).

    Accepted, in any case: a ruleset's name ("vllm-0.33"), its minor series ("0.33"), or
    any release number inside its range, bare or with a `v`, `vllm-` or `vllm==` prefix
    ("0.33.0", "v0.33.1", "vllm-0.33.0"; a local label such as "+cu129" is ignored, so
    a pod's `vllm.__version__` resolves). Anything else is `UnknownRulesetError` on
    `field`, listing the known rulesets with their ranges.
    """
    if not name.strip():
        return DEFAULT_RULESET
    release = _lookup(name)
    if release is None:
        newest = RELEASES[DEFAULT_RULESET]
        raise UnknownRulesetError.naming(
            field,
            name,
            [f"{r.name} (vLLM {r.range_text})" for r in RELEASES.values()],
            [newest.name, newest.series, newest.first, f"v{newest.first}"],
            _newer_note(name, newest),
        )
    return release.name


def _newer_note(name: str, newest: Release) -> str:
    """What to do about a release newer than every ruleset ("" for any other name)."""
    number = _release_number(name.strip().lower())
    if number is None or number < _number(newest.below):
        return ""
    release = ".".join(map(str, number))
    return (
        f"vLLM {release} is newer than every ruleset (the newest is {newest.name}); "
        + add_release_howto(release if len(number) > 2 else f"{release}.0")
    )


#: How a release the oracle does not model gets its ruleset (the command and the page that
#: say how), with `{version}` for the release.
ADD_RELEASE_HOWTO = (
    "to model it, record its answers with `make parity-record VLLM={version}` and add its "
    "ruleset (docs/selecting.md, 'Parity with vLLM, release by release')"
)


def add_release_howto(version: str) -> str:
    """`ADD_RELEASE_HOWTO` for one release ("0.35.0")."""
    return ADD_RELEASE_HOWTO.format(version=version)


def _number(text: str) -> tuple[int, ...]:
    number = version_tuple(text)
    assert number is not None, text
    return number


@dataclass(frozen=True, slots=True)
class ReleaseMatch:
    """What a reported vLLM release is compared with: `ruleset`, the ruleset whose range
    holds it, else the nearest older one (None: no ruleset is as old, or the text is no
    release number), and whether a ruleset models it (`modelled`: its range holds the
    release, and the release is a final one, not a pre-release or development build)."""

    ruleset: str | None
    modelled: bool


#: A reported version: its release number, then what follows it ("rc1", ".dev12+g1234",
#: "+cu129").
_REPORTED = re.compile(r"v?(\d+(?:\.\d+)*)([-+._a-z0-9]*)")


def match_release(version: str, releases: Mapping[str, Release] = RELEASES) -> ReleaseMatch:
    """The ruleset a pod's `vllm.__version__` is compared with, and whether it models it.

    A final release ("0.33.0", "0.33.1+cu129": a local label is a build of the release;
    major.minor.patch, as `resolve_ruleset` takes it) inside a ruleset's range is modelled
    by it. Any other release (newer than every
    ruleset, in a gap between two ranges, or a pre-release or development build, whose code
    is no release's) is not modelled and is compared with the newest ruleset whose first
    release is not newer than it: the nearest older one."""
    text = version.strip().lower()
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text.removeprefix(prefix)
            break
    reported = _REPORTED.fullmatch(text)
    if reported is None:
        return ReleaseMatch(None, False)
    number = _number(reported.group(1))
    suffix = reported.group(2)
    final = len(number) == 3 and (suffix == "" or suffix.startswith("+"))
    older = None
    for release in releases.values():
        if final and release.contains(number):
            return ReleaseMatch(release.name, True)
        if _number(release.first) <= number:
            older = release.name
    return ReleaseMatch(older, False)
