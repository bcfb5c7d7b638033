"""How the server supervises its workers: start, ping and restart timings, worker logging.

One frozen value the server builds from its settings and hands to every worker handle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    start_timeout_s: float = 180.0
    ping_interval_s: float = 5.0
    ping_timeout_s: float = 30.0
    restart_backoff_s: float = 1.0
    log_level: str = "INFO"
    log_format: str = "json"
