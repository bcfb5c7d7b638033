"""Choosing a release: the release table, the one resolver every ruleset name goes through
(spec field, `select(ruleset=)`, `--ruleset`), and the unknown-ruleset error."""

from __future__ import annotations

from typing import Any

import pytest

from service.oracle import (
    DEFAULT_RULESET,
    RULESETS,
    InvalidSpecError,
    UnknownRulesetError,
    parse_deployment,
    resolve_ruleset,
    select,
)
from service.oracle.releases import RELEASES, Release
from service.oracle.rulesets import get_ruleset, listing

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
LAYER = {"num_experts": 128, "top_k": 8, "hidden_size": 2048, "intermediate_size": 768}


def spec(**extra: Any) -> dict[str, Any]:
    return {"hf_quantization_config": GPTQ, "layer": LAYER, "platform": "h200", **extra}


SPELLINGS = [
    "vllm-0.34",
    "0.34",
    "0.34.0",
    "v0.34.0",
    "0.34.1",
    "v0.34.7",
    "vllm-0.34.0",
    "vllm==0.34.0",
    "VLLM-0.34",
    " 0.34 ",
    "0.34.0+cu129",
]
UNKNOWN = [
    "vllm-0.35",
    "0.35",
    "0.35.0",
    "0.26.0",
    "vllm-0.26",
    "0.3",
    "0.33.0.1",
    "33",
    "v",
    "vllm-9",
    "x",
]


def test_every_release_row_has_its_ruleset_and_every_ruleset_its_row() -> None:
    assert list(RULESETS) == list(RELEASES)
    for name, ruleset in RULESETS.items():
        assert ruleset.name == name and ruleset.release is RELEASES[name]


def test_the_default_is_the_newest_release() -> None:
    newest = max(RELEASES.values(), key=lambda r: tuple(map(int, r.first.split("."))))
    assert DEFAULT_RULESET == newest.name == "vllm-0.34"


def test_0_34_metadata_is_the_release_wheels() -> None:
    release = RULESETS["vllm-0.34"].release
    assert (release.first, release.below) == ("0.34.0", "0.35")
    assert (release.torch, release.humming_kernels) == ("2.14.0", "0.1.19")
    assert release.series == "0.34" and release.range_text == ">=0.34.0,<0.35"
    assert release.contains((0, 34, 0)) and release.contains((0, 34, 9))
    assert not release.contains((0, 35, 0)) and not release.contains((0, 33, 9))


def test_a_release_range_must_be_a_range() -> None:
    with pytest.raises(ValueError, match="bad release range"):
        Release("vllm-x", first="0.34.0", below="0.34", torch="", humming_kernels="")


@pytest.mark.parametrize("name", SPELLINGS)
def test_every_spelling_of_a_release_resolves_to_its_ruleset(name: str) -> None:
    assert resolve_ruleset(name) == "vllm-0.34"
    assert get_ruleset(name) is RULESETS["vllm-0.34"]


@pytest.mark.parametrize("name", SPELLINGS)
def test_the_spec_field_and_the_argument_take_the_same_spellings(name: str) -> None:
    parsed = parse_deployment(spec(ruleset=name))
    assert parsed.ruleset == "vllm-0.34"
    assert parsed.to_json()["ruleset"] == "vllm-0.34"
    assert select(spec(ruleset=name)).ruleset == "vllm-0.34"
    assert select(spec(), ruleset=name).ruleset == "vllm-0.34"


def test_a_spec_without_a_ruleset_keeps_its_normal_form() -> None:
    parsed = parse_deployment(spec())
    assert parsed.ruleset is None and "ruleset" not in parsed.to_json()
    assert parse_deployment(spec(ruleset=None)).ruleset is None
    assert select(spec()).ruleset == DEFAULT_RULESET


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_ruleset_names_the_field_and_lists_the_known(name: str) -> None:
    with pytest.raises(UnknownRulesetError) as caught:
        resolve_ruleset(name, field="--ruleset")
    (violation,) = caught.value.violations
    assert violation.field == "--ruleset"
    assert repr(name) in violation.description
    for known, release in RELEASES.items():
        assert f"{known} (vLLM {release.range_text})" in violation.description
    assert "'0.34.0'" in violation.description and "'v0.34.0'" in violation.description


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_ruleset_in_the_spec_is_a_field_violation_beside_the_others(
    name: str,
) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_deployment(spec(ruleset=name, layer={"num_experts": 8}))
    fields = [v.field for v in caught.value.violations]
    assert "ruleset" in fields and "layer.top_k" in fields
    (ruleset,) = [v for v in caught.value.violations if v.field == "ruleset"]
    assert "vllm-0.34" in ruleset.description
    with pytest.raises(UnknownRulesetError):
        select(spec(), ruleset=name)


def test_a_ruleset_that_is_no_string_is_refused() -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_deployment(spec(ruleset=33))
    assert [v.field for v in caught.value.violations] == ["ruleset"]


def test_the_argument_wins_over_the_spec() -> None:
    # The argument is checked even where the spec's would do, and decides over it.
    with pytest.raises(UnknownRulesetError):
        select(spec(ruleset="0.33"), ruleset="0.26")
    assert select(spec(ruleset="0.33"), ruleset="v0.33.0").ruleset == "vllm-0.33"
    assert select(spec(ruleset="0.33"), ruleset="0.32.0").ruleset == "vllm-0.32"
    assert select(spec(ruleset="vllm-0.32"), ruleset="0.33").ruleset == "vllm-0.33"


def test_the_listing_carries_the_release_metadata() -> None:
    entries = {entry["name"]: entry for entry in listing()}
    assert [entry["name"] for entry in listing()] == list(RELEASES)
    assert list(RELEASES)[-2:] == ["vllm-0.33", "vllm-0.34"]
    assert entries["vllm-0.34"] == {
        "name": "vllm-0.34",
        "default": True,
        "vllm": ">=0.34.0,<0.35",
        "first_version": "0.34.0",
        "below_version": "0.35",
        "torch": "2.14.0",
        "humming_kernels": "0.1.19",
        "backends": list(RULESETS["vllm-0.34"].backends),
        "moe_backends": sorted(RULESETS["vllm-0.34"].user_backends),
    }
    assert entries["vllm-0.33"]["default"] is False
    assert entries["vllm-0.32"]["default"] is False
    assert entries["vllm-0.32"]["vllm"] == ">=0.32.0,<0.33"
    assert (entries["vllm-0.32"]["torch"], entries["vllm-0.32"]["humming_kernels"]) == (
        "2.13.0",
        "0.1.17",
    )
