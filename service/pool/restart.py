"""When a dead worker is started again, and how its end is told.

A worker that dies is restarted after a back-off that doubles with each quick death, up to a
ceiling, so a worker that cannot start does not spin; one that lived a while before dying
starts over from the initial back-off.
"""

from __future__ import annotations

import signal

#: Restart back-off never grows past this.
MAX_BACKOFF_S = 30.0
#: A worker that lived this long before dying restarts after the initial back-off again.
STABLE_AFTER_S = 60.0
#: The back-off after a death with a zero initial one (a restart is never immediate twice).
MIN_GROWN_BACKOFF_S = 0.1


class RestartBackoff:
    """The back-off of one worker's restarts: `delay` is the next wait as it stands."""

    def __init__(self, initial_s: float) -> None:
        self.initial_s = initial_s
        self.delay = initial_s

    def wait_after(self, lived_s: float) -> float:
        """The wait before restarting a worker that lived `lived_s`; grows the next one."""
        if lived_s > STABLE_AFTER_S:
            self.delay = self.initial_s
        wait = self.delay
        self.delay = min(max(wait * 2, MIN_GROWN_BACKOFF_S), MAX_BACKOFF_S)
        return wait


def exit_reason(returncode: int | None) -> str:
    """How a process ended, from its return code, in words."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"
