"""DiffRulesets on the wire: the request as the data plane's `DiffQuery`, the oracle's
`RulesetDiff` as the response, and a response back as the JSON `moe-control diff --json`
prints (`service.oracle.upgrade.upgrade_json`), for the CLI client.

Each answer reuses SelectBackend's messages: a decision is a SelectBackendResponse, a
failure the SelectionFailure a FAILED_PRECONDITION would carry (codecs/selection.py), so
an answer reads back as exactly the JSON `select --json` prints for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.api.codecs import selection as codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.dataplane.upgrade import DiffQuery
from service.oracle.gate import parse_fail_on
from service.oracle.upgrade import Difference, RulesetAnswer, RulesetDiff, upgrade_json


def diff_query(request: pb.DiffRulesetsRequest) -> DiffQuery:
    """The data plane's query for a request (its deployment converted now, so a bad one
    fails before anything is decided, as does an unknown fail_on field)."""
    return DiffQuery(
        codec.deployment_to_json(request),
        tuple(request.rulesets),
        codec.platform_choice(request.platform),
        parse_fail_on(request.fail_on),
    )


def answer_to_pb(answer: RulesetAnswer) -> pb.RulesetAnswer:
    message = pb.RulesetAnswer(ruleset=answer.ruleset)
    if answer.decision is not None:
        decision = answer.decision
        assert decision.platform is not None
        message.decision.CopyFrom(codec.select_response(decision, decision.platform, None))
    else:
        assert answer.failure is not None
        message.failure.CopyFrom(codec.selection_failure_to_pb(answer.failure))
    return message


def difference_to_pb(difference: Difference, fail_on: Sequence[str]) -> pb.RulesetDifference:
    return pb.RulesetDifference(
        from_ruleset=difference.from_ruleset,
        to_ruleset=difference.to_ruleset,
        field=difference.field,
        before=difference.before,
        after=difference.after,
        cause=difference.cause,
        fails_gate=difference.fails(fail_on),
    )


def diff_response(diff: RulesetDiff, fail_on: Sequence[str]) -> pb.DiffRulesetsResponse:
    """The response, each difference marked by whether it touches a field of `fail_on`."""
    return pb.DiffRulesetsResponse(
        answers=[answer_to_pb(a) for a in diff.answers],
        differences=[difference_to_pb(d, fail_on) for d in diff.differences],
        changes=[difference_to_pb(d, fail_on) for d in diff.changes],
        fail_on=list(fail_on),
        changed=any(d.fails(fail_on) for d in diff.changes),
    )


def answer_json(message: pb.RulesetAnswer) -> dict[str, Any]:
    """An answer as `select --json` prints it: the decision, or the failure."""
    if message.WhichOneof("answer") == "decision":
        return codec.select_response_to_json(message.decision)
    return codec.selection_error_from_pb(message.failure).to_json()


def difference_json(message: pb.RulesetDifference) -> dict[str, str]:
    return {
        "field": message.field,
        "before": message.before,
        "after": message.after,
        "cause": message.cause,
    }


def upgrade_response_to_json(response: pb.DiffRulesetsResponse) -> dict[str, Any]:
    """The first-to-last upgrade of a response, as `moe-control diff --json` prints it
    locally (`upgrade_json`: both answers, the changes that fail the gate with their causes
    and, apart, the others)."""
    first, last = response.answers[0], response.answers[-1]
    return upgrade_json(
        first.ruleset,
        last.ruleset,
        answer_json(first),
        answer_json(last),
        differences=[difference_json(d) for d in response.changes if d.fails_gate],
        other_differences=[difference_json(d) for d in response.changes if not d.fails_gate],
        fail_on=tuple(response.fail_on),
    )
