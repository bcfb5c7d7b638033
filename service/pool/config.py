"""How the server supervises its workers: start, ping and restart timings, worker logging.

One frozen value the server builds from its settings and hands to every worker handle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    start_timeout_s: float = 180.0
    ping_interval_s: float = 5.0
    ping_timeout_s: float = 30.0
    restart_backoff_s: float = 1.0
    log_level: str = "INFO"
    log_format: str = "json"
    #: Environment entries every worker starts with: the settings it reads
    #: (`Settings.worker_environ`).
    worker_env: Mapping[str, str] = field(default_factory=dict)
