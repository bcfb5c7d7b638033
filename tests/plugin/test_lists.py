"""The plugin's lists are the server's: the flags it sends, the packages it probes, the
routing inputs it reads vLLM's routing method back into, the proto it speaks."""

from __future__ import annotations

from moe_control_vllm import deployment, verdicts

from service.api.codegen import PLUGIN_PROTOS, proto_files
from service.oracle.moe_config import routing_method
from service.oracle.platform import DECISION_ENV_FLAGS, KNOWN_PACKAGES
from service.oracle.spec import _parse_routing


def test_the_env_flags_it_sends_are_the_ones_the_oracle_reads() -> None:
    assert set(deployment.DECISION_ENV_FLAGS) == set(DECISION_ENV_FLAGS)


def test_every_package_it_can_report_is_one_the_oracle_knows() -> None:
    source = deployment._packages.__code__.co_consts
    reported = {c for c in source if isinstance(c, str) and c in KNOWN_PACKAGES}
    assert reported == set(KNOWN_PACKAGES)


def test_each_routing_method_reads_back_to_itself() -> None:
    """The routing inputs sent for vLLM's RoutingMethodType give the oracle that method."""
    for name, inputs in deployment.ROUTING_INPUTS.items():
        violations: list[object] = []
        assert routing_method(_parse_routing(dict(inputs), violations)) == name
        assert not violations


def test_the_verdicts_are_the_oracles() -> None:
    from service.oracle.decision import Verdict

    assert {verdicts.SELECTED, verdicts.REJECTED, verdicts.NOT_REACHED} == {
        v.value for v in Verdict
    }


def test_the_plugin_speaks_a_proto_of_the_contract() -> None:
    names = {str(p).split("protos/", 1)[1] for p in proto_files()}
    assert set(PLUGIN_PROTOS) <= names
