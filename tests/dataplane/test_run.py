"""RunMoE's checks that need no layer and no worker, called on the use case directly: each
names the request field at fault, in the order the use case judges them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.dataplane.errors import RunInputError, RunResourceError
from service.dataplane.run import REPLY_ALLOWANCE, Runner, RunRequest, WireTensor
from service.metrics import Metrics
from service.settings import Settings


def tensor(dtype: str, shape: tuple[int, ...], nbytes: int | None = None) -> WireTensor:
    size = 2 * (shape[0] * shape[1]) if nbytes is None else nbytes
    return WireTensor("", dtype, 0, shape, bytes(size))


def run(request: RunRequest, **settings: Any) -> None:
    runner = Runner(None, Metrics(), Settings(**settings), lambda: None)  # type: ignore[arg-type]
    asyncio.run(runner.run(request, lambda result: result))


HIDDEN = tensor("bfloat16", (4, 64))
LOGITS = tensor("float32", (4, 8), 4 * 32)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (RunRequest(hidden_states=None, weights="layer_id"), "hidden_states"),
        (RunRequest(hidden_states=tensor("int32", (4, 64)), weights=None), "hidden_states.dtype"),
        (
            RunRequest(hidden_states=tensor("bfloat16", (256,), 512), weights=None),
            "hidden_states.shape",
        ),
        (RunRequest(hidden_states=HIDDEN, weights=None), "weights"),
        (RunRequest(hidden_states=HIDDEN, weights="layer_id"), "routing"),
        (
            RunRequest(
                hidden_states=HIDDEN,
                weights="layer_id",
                router_logits=LOGITS,
                timed_iterations=1001,
            ),
            "timed_iterations",
        ),
        (
            RunRequest(hidden_states=HIDDEN, weights="layer_id", router_logits=tensor("", (4, 8))),
            "router_logits.dtype",
        ),
        (
            RunRequest(
                hidden_states=tensor("bfloat16", (4, 64), 10),
                weights="layer_id",
                router_logits=LOGITS,
            ),
            "hidden_states.data",
        ),
        (RunRequest(hidden_states=HIDDEN, weights="layer_id", router_logits=LOGITS), "layer_id"),
    ],
)
def test_checks_name_the_field(request_: RunRequest, field: str) -> None:
    with pytest.raises(RunInputError) as caught:
        run(request_)
    assert caught.value.field == field


def test_the_token_limit_is_a_resource_error_naming_its_setting() -> None:
    with pytest.raises(RunResourceError) as caught:
        run(RunRequest(hidden_states=HIDDEN, weights="layer_id"), run_max_tokens=2)
    assert caught.value.limit == "run_max_tokens"


def test_an_answer_over_the_send_limit_is_refused_before_any_work() -> None:
    # [4, 64] bf16 is 512 bytes of output: with the reply's other fields, over a 4 KiB limit,
    # and refused before the worker (None here) is asked for anything.
    limit = REPLY_ALLOWANCE + 4 * 64 * 2 - 1
    with pytest.raises(RunResourceError) as caught:
        run(RunRequest(hidden_states=HIDDEN, weights="layer_id"), max_send_message_bytes=limit)
    assert (caught.value.limit, caught.value.field) == (
        "max_send_message_bytes",
        "hidden_states.shape",
    )
    assert str(limit) in caught.value.description


def test_an_answer_that_fits_the_send_limit_goes_on_to_the_next_check() -> None:
    with pytest.raises(RunInputError) as caught:
        run(
            RunRequest(hidden_states=HIDDEN, weights="layer_id"),
            max_send_message_bytes=REPLY_ALLOWANCE + 4 * 64 * 2,
        )
    assert caught.value.field == "routing"
