"""The clients' call metadata (the bearer token from the caller, else the environment) and
which methods they retry."""

from __future__ import annotations

import pytest

from service.client.channel import TOKEN_ENV, call_metadata


def test_a_given_token_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert call_metadata("given") == (("authorization", "Bearer given"),)
    assert call_metadata(None) == (("authorization", "Bearer from-env"),)


def test_no_token_sends_no_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert call_metadata(None) == ()
    assert call_metadata("") == ()


def test_the_retried_methods_are_real_and_leave_the_writers_out() -> None:
    from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
    from service.client.channel import IDEMPOTENT_METHODS

    methods = set(pb.DESCRIPTOR.services_by_name["MoeControlService"].methods_by_name)
    assert IDEMPOTENT_METHODS.issubset(methods)
    assert not IDEMPOTENT_METHODS & {"ConvertWeights", "UnloadLayer"}
