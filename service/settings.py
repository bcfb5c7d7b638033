"""Server settings: one typed object, read from flags, then `MOE_CONTROL_*` environment
variables, then defaults (in that order of precedence).

Every field has a flag (`--max-concurrent-rpcs`) and an environment variable
(`MOE_CONTROL_MAX_CONCURRENT_RPCS`) derived from its name. The help text in each field's
metadata is the one reference: `moe-control serve --help` prints it, and
`service.settings_doc` (`make docs`) writes docs/configuration.md from it.

Every `MOE_CONTROL_*` variable the server or its workers read is a field here. The few a
worker reads (`WORKER_FIELDS`) reach it through its environment: the server sets them from
its own settings (`worker_environ`), so a flag given to `serve` reaches every worker, and
a worker (or `moe-control run`, which runs the worker's code) reads them with
`worker_setting`, converted and defaulted as here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.errors import MoeControlError

ENV_PREFIX = "MOE_CONTROL_"
MIB = 1024 * 1024
#: CPU-heavy requests (matrices, diffs, the what-would-change search) get this long by default.
CPU_BUDGET_S = 20.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class SettingsError(MoeControlError, ValueError):
    """A setting has a bad value, or settings contradict each other."""


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything `moe-control serve` can be told."""

    host: str = field(default="127.0.0.1", metadata=_doc("gRPC bind address ('0.0.0.0' in pods)"))
    port: int = field(default=50151, metadata=_doc("gRPC port (0: any free port)"))
    metrics_host: str = field(default="127.0.0.1", metadata=_doc("bind address of /metrics"))
    metrics_port: int = field(
        default=9464, metadata=_doc("Prometheus /metrics HTTP port (0: any free port)")
    )
    metrics_enabled: bool = field(default=True, metadata=_doc("serve /metrics at all"))
    http_port: int = field(
        default=8151,
        metadata=_doc(
            "HTTP/JSON API port on the gRPC bind address (docs/http.md), served by every "
            "server process with the same token, TLS, size and concurrency limits "
            "(0: off)"
        ),
    )
    max_receive_message_bytes: int = field(
        default=16 * MIB, metadata=_doc("largest request message the server accepts")
    )
    max_send_message_bytes: int = field(
        default=16 * MIB, metadata=_doc("largest response message the server sends")
    )
    max_concurrent_rpcs: int = field(
        default=512,
        metadata=_doc(
            "RPCs served at once per server process (grpc's own limit); more get "
            "RESOURCE_EXHAUSTED without details (0: no limit)"
        ),
    )
    max_concurrent_select: int = field(
        default=384,
        metadata=_doc(
            "SelectBackend and DiffRulesets calls served at once per server process; more get "
            "RESOURCE_EXHAUSTED, leaving the global limit's other slots to the other methods "
            "(0: no limit)"
        ),
    )
    max_concurrent_convert: int = field(
        default=8,
        metadata=_doc(
            "ConvertWeights streams open at once, server-wide (each may hold a layer in "
            "shared memory, and holds its slot until it ends, cancelled or not); more get "
            "RESOURCE_EXHAUSTED (0: no limit)"
        ),
    )
    max_concurrent_run: int = field(
        default=64,
        metadata=_doc(
            "RunMoE calls served at once, server-wide; more get RESOURCE_EXHAUSTED (0: no limit)"
        ),
    )
    concurrency_wait_s: float = field(
        default=0.0,
        metadata=_doc(
            "a call over its method's limit waits at most this long (0..10 s) for a slot "
            "before it is refused (0: refused at once; calls are never queued longer)"
        ),
    )
    server_processes: int = field(
        default=0,
        metadata=_doc(
            "server processes sharing the gRPC and HTTP ports (docs/server.md, Ports), each "
            "with its own event loop; the kernel spreads connections, not calls, over them "
            "(0: one per CPU "
            "core this process may use: its affinity, capped by a cgroup CPU quota)"
        ),
    )
    select_cache_mib: int = field(
        default=32,
        metadata=_doc(
            "memory for remembered SelectBackend answers, per process (the same request "
            "bytes while no worker changes get the same answer, still counted in the "
            "metrics; 0: off)"
        ),
    )
    cpu_threads: int = field(
        default=1,
        metadata=_doc(
            "threads per server process that decide CPU-heavy requests (matrices, diffs, "
            "the what-would-change search, big specs) off its event loop, so health, "
            "readiness and plain selections keep answering; more such requests wait their "
            "turn"
        ),
    )
    cpu_budget_s: float = field(
        default=CPU_BUDGET_S,
        metadata=_doc(
            "seconds a CPU-heavy request may take, waiting for a thread included (a shorter "
            "client deadline wins): past it, DEADLINE_EXCEEDED (HTTP 504), or for a "
            "matrix, the cells not reached marked as not decided"
        ),
    )
    keepalive_time_s: float = field(
        default=60.0, metadata=_doc("server pings an idle connection this often")
    )
    keepalive_timeout_s: float = field(
        default=20.0, metadata=_doc("a ping unanswered this long closes the connection")
    )
    keepalive_min_ping_interval_s: float = field(
        default=10.0,
        metadata=_doc("clients may ping this often without data (long unary calls need it)"),
    )
    grace_s: float = field(
        default=10.0, metadata=_doc("on SIGTERM/SIGINT, in-flight RPCs get this long to finish")
    )
    tls_cert: Path | None = field(
        default=None, metadata=_doc("PEM server certificate chain; enables TLS")
    )
    tls_key: Path | None = field(
        default=None, metadata=_doc("PEM private key of tls_cert (the two go together)")
    )
    tls_client_ca: Path | None = field(
        default=None, metadata=_doc("PEM CA bundle; clients must present a cert it signed (mTLS)")
    )
    auth_token: str | None = field(
        default=None,
        metadata=_doc("require 'authorization: Bearer <token>' on every RPC but health"),
    )
    auth_token_file: Path | None = field(
        default=None, metadata=_doc("read auth_token from this file (kept out of the env)")
    )
    devices: str = field(
        default="auto",
        metadata=_doc(
            "worker devices: 'auto' (every visible GPU, else the CPU), 'cpu', "
            "or a list like 'cuda:0,cuda:1'"
        ),
    )
    cpu_workers: int = field(
        default=1,
        metadata=_doc(
            "CPU workers to start where the devices come to the CPU alone ('cpu', or 'auto' "
            "without a GPU); more than 1 exercises the multi-worker paths without GPUs"
        ),
    )
    worker_start_timeout_s: float = field(
        default=180.0, metadata=_doc("a worker must report its platform within this")
    )
    worker_ping_interval_s: float = field(
        default=5.0, metadata=_doc("the supervisor pings each worker this often")
    )
    worker_ping_timeout_s: float = field(
        default=30.0, metadata=_doc("a worker silent this long is killed and restarted")
    )
    worker_restart_backoff_s: float = field(
        default=1.0, metadata=_doc("first restart delay; doubles up to 30 s while it keeps dying")
    )
    data_root: Path | None = field(
        default=None,
        metadata=_doc(
            "directory that path-mode conversions may read and write (checkpoints in, "
            "converted checkpoints out); unset: path mode is refused"
        ),
    )
    convert_max_layer_bytes: int = field(
        default=16 * 1024 * MIB,
        metadata=_doc("most tensor bytes one inline ConvertWeights call may declare"),
    )
    convert_chunk_bytes: int = field(
        default=1 * MIB, metadata=_doc("default size of the tensor chunks ConvertWeights sends")
    )
    layer_budget_mib: int = field(
        default=8192,
        metadata=_doc(
            "device memory each worker may hold in kept layers; the least recently used "
            "are evicted to make room (0: no limit)"
        ),
    )
    run_max_tokens: int = field(
        default=16384, metadata=_doc("most tokens (hidden_states rows) one RunMoE may carry")
    )
    run_max_inline_bytes: int = field(
        default=64 * MIB,
        metadata=_doc("most bytes of inline weights one RunMoE may carry (larger: keep_loaded)"),
    )
    segment_dir: Path | None = field(
        default=None,
        metadata=_doc(
            "where tensors shared with workers live (default: /dev/shm when it has room, "
            "else the temp directory)"
        ),
    )
    state_dir: Path | None = field(
        default=None,
        metadata=_doc(
            "where SelectBackend's measured policy keeps its timings and ReportDecisions its "
            "observed decisions (JSON files, each replaced atomically); unset: in memory "
            "only, lost at a restart"
        ),
    )
    observed_max_deployments: int = field(
        default=4096,
        metadata=_doc(
            "distinct observed deployments (ReportDecisions) kept; the least recently "
            "reported are dropped first"
        ),
    )
    observed_ruleset: str | None = field(
        default=None,
        metadata=_doc(
            "compare every observed decision with this ruleset (any form --ruleset takes) "
            "instead of the reporting vLLM release's own; unset: the release's"
        ),
    )
    malloc_tuning: bool = field(
        default=True,
        metadata=_doc(
            "set fixed glibc malloc thresholds (mmap 64 MiB, trim 256 MiB) in the server "
            "process at start, so big messages' buffers are kept for the next call; off: glibc's "
            "defaults (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ win either way)"
        ),
    )
    triton_decode: bool = field(
        default=True,
        metadata=_doc(
            "TRITON may take its decode kernels for few routes per expert (off: its prefill "
            "kernels for every batch); read by each worker"
        ),
    )
    marlin_library: Path | None = field(
        default=None,
        metadata=_doc(
            "path of vLLM's Marlin MoE library (_moe_C_stable_libtorch.abi3.so) for MARLIN "
            "and BATCHED_MARLIN where vLLM is not installed; unset: the one inside an "
            "installed vllm package; read by each worker"
        ),
    )
    log_level: str = field(default="INFO", metadata=_doc("DEBUG, INFO, WARNING or ERROR"))
    log_format: str = field(default="json", metadata=_doc("'json' (one object a line) or 'text'"))

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("port", "metrics_port", "http_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                problems.append(f"{name} must be in 0..65535, got {value}")
        for name in (
            "max_receive_message_bytes",
            "max_send_message_bytes",
            "convert_max_layer_bytes",
            "convert_chunk_bytes",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive")
        for name in (
            "max_concurrent_rpcs",
            "max_concurrent_select",
            "max_concurrent_convert",
            "max_concurrent_run",
            "server_processes",
            "select_cache_mib",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if self.cpu_workers < 1:
            problems.append("cpu_workers must be >= 1")
        if self.cpu_threads < 1:
            problems.append("cpu_threads must be >= 1")
        if not self.cpu_budget_s > 0:
            problems.append("cpu_budget_s must be > 0")
        if self.observed_max_deployments < 1:
            problems.append("observed_max_deployments must be >= 1")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.auth_token is not None and self.auth_token_file is not None:
            problems.append("give auth_token or auth_token_file, not both")
        if self.auth_token == "":
            problems.append("auth_token must not be empty")
        if self.log_format not in ("json", "text"):
            problems.append(f"log_format must be 'json' or 'text', got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            problems.append(
                f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        for name in (
            "keepalive_time_s",
            "keepalive_timeout_s",
            "keepalive_min_ping_interval_s",
            "worker_start_timeout_s",
            "worker_ping_interval_s",
            "worker_ping_timeout_s",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive")
        if not 0 <= self.concurrency_wait_s <= 10:
            problems.append("concurrency_wait_s must be in 0..10 (a short wait, not a queue)")
        if self.grace_s < 0 or self.worker_restart_backoff_s < 0:
            problems.append("grace_s and worker_restart_backoff_s must be >= 0")
        if problems:
            raise SettingsError("; ".join(problems))

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None

    def process_count(self) -> int:
        """How many gRPC server processes to run: `server_processes`, or for 0 the CPU
        cores this process may use (its affinity, bounded by a cgroup CPU quota: a pod
        limited to 2 CPUs on a 64-core node runs 2)."""
        if self.server_processes:
            return self.server_processes
        return usable_cpus()

    def token(self) -> str | None:
        """The bearer token, read from auth_token_file when that is how it was given."""
        if self.auth_token_file is not None:
            try:
                text = self.auth_token_file.read_text().strip()
            except OSError as exc:
                raise SettingsError(f"auth_token_file: {exc}") from None
            if not text:
                raise SettingsError(f"auth_token_file {self.auth_token_file} is empty")
            return text
        return self.auth_token

    def grpc_options(self, *, reuseport: bool = False) -> list[tuple[str, Any]]:
        """Channel arguments of the gRPC server (`reuseport`: the port is shared by several
        server processes)."""
        return [
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            (
                "grpc.http2.min_recv_ping_interval_without_data_ms",
                int(self.keepalive_min_ping_interval_s * 1000),
            ),
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 1 if reuseport else 0),
        ]

    def worker_environ(self) -> dict[str, str]:
        """The environment entries that hand a worker the settings it reads (those set)."""
        out: dict[str, str] = {}
        for name in WORKER_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[self.env_name(name)] = (
                    str(value).lower() if isinstance(value, bool) else str(value)
                )
        return out

    # -----------------------------------------------------------------------------------
    # Sources

    @staticmethod
    def env_name(name: str) -> str:
        return ENV_PREFIX + name.upper()

    @staticmethod
    def flag_name(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field; unset flags fall back to the environment, then the default."""
        for f in dataclasses.fields(cls):
            kind = _kind(f)
            default = f.default
            help_text = (
                f"{f.metadata.get('help', '')} [env {cls.env_name(f.name)}; default {default}]"
            )
            if kind is bool:
                parser.add_argument(
                    cls.flag_name(f.name),
                    dest=f.name,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
            else:
                parser.add_argument(
                    cls.flag_name(f.name),
                    dest=f.name,
                    default=None,
                    metavar=f.name.upper(),
                    help=help_text,
                )

    @classmethod
    def load(
        cls,
        args: argparse.Namespace | Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Settings:
        """Flags (values that are not None), then environment variables, then defaults."""
        given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
        env = environ if environ is not None else {}
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = given.get(f.name)
            source = cls.flag_name(f.name)
            if raw is None and cls.env_name(f.name) in env:
                raw = env[cls.env_name(f.name)]
                source = cls.env_name(f.name)
            if raw is None:
                continue
            values[f.name] = _convert(f, raw, source)
        return cls(**values)


#: The settings a worker process reads (from its environment; see the module doc).
WORKER_FIELDS = ("triton_decode", "marlin_library")


def worker_setting(name: str, environ: Mapping[str, str]) -> Any:
    """A worker's setting from its environment (its default when unset); a bad value is a
    `SettingsError` naming the variable."""
    if name not in WORKER_FIELDS:
        raise KeyError(f"{name} is not a worker setting; one of {WORKER_FIELDS}")
    f = next(f for f in dataclasses.fields(Settings) if f.name == name)
    env_name = Settings.env_name(name)
    if env_name not in environ:
        return f.default
    return _convert(f, environ[env_name], env_name)


def usable_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPU cores this process may use: its affinity, bounded by the cgroup v2 quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _kind(f: dataclasses.Field[Any]) -> type:
    annotation = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("Path", Path)):
        if annotation.startswith(name):
            return kind
    return str


def _convert(f: dataclasses.Field[Any], raw: Any, source: str) -> Any:
    kind = _kind(f)
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    try:
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("expected true or false")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is Path:
            return Path(text) if text else None
    except ValueError as exc:
        raise SettingsError(f"{source}: bad value {raw!r} ({exc})") from None
    return text if text or f.default is not None else None
