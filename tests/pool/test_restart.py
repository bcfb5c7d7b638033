"""The restart back-off: doubling after quick deaths, capped, reset after a stable run."""

from __future__ import annotations

import signal

from service.pool.restart import MAX_BACKOFF_S, STABLE_AFTER_S, RestartBackoff, exit_reason


def test_quick_deaths_double_the_wait_up_to_the_cap() -> None:
    backoff = RestartBackoff(1.0)
    waits = [backoff.wait_after(0.5) for _ in range(8)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]


def test_a_worker_that_lived_long_restarts_after_the_initial_wait() -> None:
    backoff = RestartBackoff(1.0)
    backoff.wait_after(0.5)
    backoff.wait_after(0.5)
    assert backoff.delay == 4.0
    assert backoff.wait_after(STABLE_AFTER_S + 1) == 1.0
    assert backoff.delay == 2.0


def test_a_zero_initial_wait_still_grows() -> None:
    backoff = RestartBackoff(0.0)
    assert backoff.wait_after(0.0) == 0.0
    assert backoff.wait_after(0.0) == 0.1


def test_exit_reasons_in_words() -> None:
    assert exit_reason(None) == "still running"
    assert exit_reason(3) == "exited with status 3"
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-200) == "killed by signal 200"
