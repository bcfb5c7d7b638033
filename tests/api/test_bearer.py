"""The bearer-token check both doors run (gRPC metadata, the HTTP header): the first
`Bearer <token>` among a request's authorization values decides; other schemes, an empty
token or no value at all are refused."""

from __future__ import annotations

import pytest

from service.api.bearer import BearerToken
from service.api.errors import UnauthenticatedError
from service.http.auth import BearerCheck

TOKEN = "s3cret-token"
CASES = [
    ([f"Bearer {TOKEN}"], True),
    ([f"bearer {TOKEN}"], True),
    ([f"BEARER   {TOKEN}  "], True),
    (["Bearer wrong"], False),
    ([f"Bearer {TOKEN}x"], False),
    (["Bearer"], False),
    (["Bearer  "], False),
    ([f"Basic {TOKEN}"], False),
    ([TOKEN], False),
    ([], False),
    # another scheme first is passed over; the first bearer value decides
    (["Basic x", f"Bearer {TOKEN}"], True),
    (["Bearer wrong", f"Bearer {TOKEN}"], False),
]


@pytest.mark.parametrize(("values", "accepted"), CASES)
def test_the_check(values: list[str], accepted: bool) -> None:
    assert BearerToken(TOKEN).accepts(values) is accepted


@pytest.mark.parametrize(("values", "accepted"), [c for c in CASES if len(c[0]) <= 1])
def test_the_http_door_asks_the_same_check(values: list[str], accepted: bool) -> None:
    check = BearerCheck(TOKEN)
    header = values[0] if values else None
    if accepted:
        check.check(header)
    else:
        with pytest.raises(UnauthenticatedError):
            check.check(header)


def test_no_token_configured_lets_every_request_in() -> None:
    check = BearerCheck(None)
    assert not check.enabled
    check.check(None)
