"""What a reported vLLM release is compared with (`match_release`): the ruleset whose range
holds it, else the nearest older one with the release marked as not modelled; and the
unknown-ruleset error for a release newer than every ruleset, which says how to add one.

Written against the release table, not its current rows, so it holds as releases are added.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest

from service.oracle import UnknownRulesetError, resolve_ruleset
from service.oracle.releases import (
    DEFAULT_RULESET,
    RELEASES,
    Release,
    ReleaseMatch,
    add_release_howto,
    match_release,
)

OLDEST, NEWEST = RELEASES[next(iter(RELEASES))], RELEASES[DEFAULT_RULESET]


def _bump(version: str, minor: int, patch: int = 0) -> str:
    """A release `minor` minor versions after `version`'s series, patch `patch`."""
    major, base = (int(part) for part in version.split(".")[:2])
    return f"{major}.{base + minor}.{patch}"


def test_every_release_in_a_range_is_modelled_by_its_ruleset() -> None:
    for name, release in RELEASES.items():
        for version in (release.first, f"{release.first}+cu129", f"v{release.first}"):
            assert match_release(version) == ReleaseMatch(name, True)
        patch = f"{release.series}.7"  # a later patch of the series, inside the range
        assert match_release(patch) == ReleaseMatch(name, True)


@pytest.mark.parametrize("minor", [0, 1, 2, 40])
def test_a_release_newer_than_every_ruleset_is_compared_with_the_newest(minor: int) -> None:
    version = _bump(NEWEST.below, minor, patch=minor % 3)
    assert match_release(version) == ReleaseMatch(NEWEST.name, False)
    assert match_release(f"vllm-{version}+cu130") == ReleaseMatch(NEWEST.name, False)


@pytest.mark.parametrize("suffix", ["rc1", ".dev12+g0a1b2c3", ".post1", "a2"])
def test_a_pre_release_or_development_build_is_not_modelled(suffix: str) -> None:
    """Its code is no release's: compared with the ruleset of its number, not modelled."""
    for name, release in RELEASES.items():
        assert match_release(f"{release.first}{suffix}") == ReleaseMatch(name, False)


def test_a_release_in_a_gap_between_two_ranges_is_compared_with_the_older() -> None:
    """A range narrowed by a patch that changes the rules, with no ruleset for it yet."""
    table = MappingProxyType(
        {
            "old": Release("old", first="1.0.0", below="1.0.3", torch="t", humming_kernels="h"),
            "new": Release("new", first="1.2.0", below="1.3", torch="t", humming_kernels="h"),
        }
    )
    assert match_release("1.0.2", table) == ReleaseMatch("old", True)
    assert match_release("1.0.3", table) == ReleaseMatch("old", False)
    assert match_release("1.1.9", table) == ReleaseMatch("old", False)
    assert match_release("1.2.4", table) == ReleaseMatch("new", True)
    assert match_release("1.3.0", table) == ReleaseMatch("new", False)


@pytest.mark.parametrize("version", ["", "unknown", "0.1.0", "v", "x.y.z", "0.33.0 beta"])
def test_no_release_number_or_one_older_than_every_ruleset_has_none(version: str) -> None:
    assert match_release(version) == ReleaseMatch(None, False)


def test_two_or_four_part_numbers_are_compared_but_not_modelled() -> None:
    """`resolve_ruleset` takes major.minor.patch; a pod reports a release as that."""
    assert match_release(NEWEST.first + ".1") == ReleaseMatch(NEWEST.name, False)
    assert match_release(OLDEST.first) == ReleaseMatch(OLDEST.name, True)


@pytest.mark.parametrize("form", ["vllm=={v}", "{v}", "v{v}", "vllm-{v}"])
def test_asking_for_a_newer_release_names_the_newest_and_how_to_add_one(form: str) -> None:
    version = _bump(NEWEST.below, 1)
    with pytest.raises(UnknownRulesetError) as caught:
        resolve_ruleset(form.format(v=version))
    (violation,) = caught.value.violations
    assert violation.field == "ruleset"
    assert f"vLLM {version} is newer than every ruleset (the newest is {NEWEST.name})" in (
        violation.description
    )
    assert violation.description.endswith(add_release_howto(version))
    assert version in add_release_howto(version)


def test_an_unknown_name_that_is_no_newer_release_says_nothing_of_adding_one() -> None:
    for name in ("nope", "0.1.0", f"{OLDEST.series}.0.1"):
        with pytest.raises(UnknownRulesetError) as caught:
            resolve_ruleset(name)
        assert "newer than every ruleset" not in str(caught.value)
