"""ListRulesets on the wire: the oracle's ruleset listing (`rulesets.listing`) as
RulesetInfo messages, and back, so that a remote `moe-control rulesets` prints what a
local one does."""

from __future__ import annotations

from typing import Any

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import selection_pb2
from service.oracle.releases import release_range
from service.oracle.rulesets import listing


def rulesets_response() -> pb.ListRulesetsResponse:
    """Every ruleset the oracle carries, oldest release first."""
    return pb.ListRulesetsResponse(
        rulesets=[
            selection_pb2.RulesetInfo(
                name=entry["name"],
                first_version=entry["first_version"],
                below_version=entry["below_version"],
                torch_version=entry["torch"],
                humming_kernels_version=entry["humming_kernels"],
                is_default=entry["default"],
                backends=entry["backends"],
                moe_backends=entry["moe_backends"],
            )
            for entry in listing()
        ]
    )


def rulesets_from_pb(response: pb.ListRulesetsResponse) -> list[dict[str, Any]]:
    """A response as the listing's JSON (the range text rebuilt from its two ends)."""
    return [
        {
            "name": info.name,
            "default": info.is_default,
            "vllm": release_range(info.first_version, info.below_version),
            "first_version": info.first_version,
            "below_version": info.below_version,
            "torch": info.torch_version,
            "humming_kernels": info.humming_kernels_version,
            "backends": list(info.backends),
            "moe_backends": list(info.moe_backends),
        }
        for info in response.rulesets
    ]
