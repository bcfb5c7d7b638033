"""DiffRulesets from the client side, for `moe-control diff --server`.

`remote_upgrade` asks a server for one deployment's answers under every ruleset of an
upgrade and returns exactly the JSON the local `moe-control diff --json` prints for it
(`service.oracle.upgrade.upgrade_json`). Failures raise `RemoteSelectionError` with the
local CLI's error shapes (`{"invalid": [...]}` for bad input, a server error otherwise),
as `remote_select` does; DiffRulesets is idempotent, so the session retries UNAVAILABLE.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from service.api.codecs.upgrade import upgrade_response_to_json
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.client.channel import Session
from service.client.select import remote_failure


def remote_upgrade(
    session: Session,
    spec: Mapping[str, Any],
    rulesets: Sequence[str],
    fail_on: Sequence[str] = (),
) -> dict[str, Any]:
    """The upgrade from the first of `rulesets` to the last, answered under each of them
    (an upgrade's chain, so that each change names the release that brings it), gated on
    the fields `fail_on` (empty: the server's default). Without a "platform" in the spec,
    the server decides for its own worker's platform."""
    request = pb.DiffRulesetsRequest(
        spec_json=json.dumps(spec), rulesets=list(rulesets), fail_on=list(fail_on)
    )
    try:
        response = session.unary("DiffRulesets", request)
    except grpc.RpcError as error:
        raise remote_failure(error) from None
    return upgrade_response_to_json(response)
