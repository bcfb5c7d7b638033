"""A bounded soak of the real server over loopback gRPC: every RPC at once, limits provoked.

Why: the unit and hostile-input suites call one RPC at a time; a server that serves each
call correctly can still leak memory or file descriptors, leave tensor segments or kept
layers behind, mix up answers or fall over when all its paths run together for minutes.
This drives them together and checks what a long-running service must keep true.

What it does: starts `moe-control serve` (a CPU worker, one server process, free loopback
ports) with deliberately small limits, writes a small synthetic checkpoint under its data
root, keeps two converted layers loaded, then runs asyncio clients for `--seconds` (or until
`--max-calls`), each on its own connection:

- SelectBackend over a pool of deployments (quantization methods x presets x shapes x forced
  backends, as spec JSON or a model's config.json), each answer checked against the library;
- ConvertWeights inline (a small layer streamed in chunks to TRITON / EMULATION / MARLIN,
  the returned tensors checked against their SHA-256; sometimes kept loaded, run, listed and
  unloaded) and path mode (the whole checkpoint under the data root, sometimes resumed);
- RunMoE on the kept layers (router logits or given top-k) and with inline weights;
- GetPlatform, ListPlatformPresets, ListRulesets, DiffRulesets (an upgrade from the oldest
  ruleset to the newest, checked against the library), SelectMatrix (a small matrix, each
  cell checked against the library), ListWorkers, ListLayers, and health checks;
- a prober that provokes every configured limit on purpose, in turn: a request over
  `--max-receive-message-bytes` (unary, and one chunk of a stream), an answer over
  `--max-send-message-bytes`, more tokens than `--run-max-tokens`, inline weights over
  `--run-max-inline-bytes`, a kept layer over `--layer-budget-mib`, a burst of held
  health Watch streams past `--max-concurrent-rpcs`, and a burst of held ConvertWeights
  streams past the per-method `--max-concurrent-convert`. Each must answer RESOURCE_EXHAUSTED.

Pass criteria (exit status 1 when one fails):

- every call answers OK with a correct answer, except RESOURCE_EXHAUSTED where a limit was
  provoked: the probe itself, or any call that overlapped a concurrency burst and was refused
  by the concurrent-RPC limit (or, during a ConvertWeights burst, a conversion refused by
  the convert limit: never another method); a probe that does not get RESOURCE_EXHAUSTED
  is a failure;
- every method ran in the measured window, and every limit was provoked at least once;
- the server and its worker are alive at the end, the worker never restarted, no tensor
  segment and no transient kept layer is left once the clients stop;
- memory flat: after the warm-up the samples are split into thirds by time, and the median
  anonymous RSS (the heap: RssAnon; VmRSS also counts the shared tensor segments mapped for
  calls in flight, reported beside it) of the last third (server + worker) is within
  `--rss-tolerance` (default 10 %) plus `--rss-slack-mib` (8 MiB) of the first third's;
- no error-level line in the server's log;
- open file descriptors, once the clients have stopped and idle segments and mappings are
  gone (waited for, up to `--settle`), at most `--fd-slack` (8) above the count before the
  load plus the client connections still open (under load the count follows the calls in
  flight, so it is reported, not judged).

Per method it reports calls, throughput, p50/p90/p99/max latency of OK calls in the
measured window (after `--warmup`) and the codes seen; `--markdown PATH` writes the same
tables, `--json PATH` the whole report. Loopback only; the run stops by itself.

    .venv/bin/python bench/soak.py --seconds 300 --markdown build/soak.md     # make soak
    .venv/bin/python bench/soak.py --seconds 12 --warmup 3 --json report.json  # the test
    .venv/bin/python bench/soak.py --seconds 90 --clients select=0,run=6     # one kind more

Error-level lines of the server's log are counted, shown and judged: a normal run, limits
provoked included, logs none (a client's own cancel is logged at info).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from _serve import listening, serve_command  # bench/_serve.py (bench/ is on sys.path)
from grpc_health.v1 import health_pb2

from service.api.codecs import conversion as convert_codec
from service.api.codecs import selection as codec
from service.api.codecs import upgrade as upgrade_codec
from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
from service.api.generated.moe_control.v1 import observed_pb2, platform_pb2, tensor_pb2
from service.client.convert import header_for, tensor_requests
from service.client.run import deployment_pb, run_request
from service.formats.io.safetensors import tensor_bytes
from service.formats.io.streaming import FROM_TORCH, TensorSpec
from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
from service.formats.synthetic.checkpoints import SyntheticSpec, write_synthetic_checkpoint
from service.formats.synthetic.quantize import random_layer
from service.kernels.routing import topk_route
from service.oracle import RULESETS, InvalidSpecError, OracleError, select
from service.oracle.upgrade import upgrade, upgrade_chain

SERVICE = "/moe_control.v1.MoeControlService/"
#: DiffRulesets' deployment: a GELU_TANH layer on a CPU (vLLM 0.33 runs it on CPU, 0.32 fails).
DIFF_SPEC: dict[str, Any] = {
    "hf_quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    },
    "layer": {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "activation": "gelu_tanh",
    },
    "platform": "cpu",
}
HEALTH = "/grpc.health.v1.Health/"
READINESS = "moe_control.v1.MoeControlService"
MIB = 1024 * 1024

#: The limits the server is started with; the prober exceeds each of them.
LIMITS = {
    "max_concurrent_rpcs": 48,
    "max_receive_message_bytes": 2 * MIB,
    "max_send_message_bytes": 1 * MIB,
    "run_max_tokens": 4096,
    "run_max_inline_bytes": 256 * 1024,
    "layer_budget_mib": 4,
    "convert_chunk_bytes": 256 * 1024,
    # Per method (limits.py): above what the convert clients hold at once (2 inline, 1
    # checkpoint, the prober's and setup's streams), so only the prober's burst reaches it.
    "max_concurrent_convert": 6,
}

#: The layer every conversion and forward uses (GPTQ int4, group 32).
QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
E, TOP_K, H, I = 4, 2, 128, 128  # noqa: E741
#: A layer that converts fine but is larger than the whole layer budget once converted.
BIG = (8, 256, 512)

#: Clients per kind (each an asyncio task with its own connection).
CLIENTS = {
    "select": 5,
    "convert": 2,
    "checkpoint": 1,
    "run": 3,
    "listing": 1,
    "health": 1,
    "prober": 1,
}

#: Every row the report must show calls for (the probes have their own rows).
METHODS = (
    "SelectBackend",
    "ConvertWeights (inline)",
    "ConvertWeights (checkpoint)",
    "RunMoE (layer)",
    "RunMoE (inline)",
    "GetPlatform",
    "ListPlatformPresets",
    "ListRulesets",
    "DiffRulesets",
    "SelectMatrix",
    "ListWorkers",
    "ListLayers",
    "UnloadLayer",
    "ReportDecisions",
    "ListObservedDecisions",
    "Health.Check",
)
#: The limits the prober provokes: row -> what the RESOURCE_EXHAUSTED message must say.
PROBES = {
    "limit: request > max_receive_message_bytes": "Received message larger than max",
    "limit: stream chunk > max_receive_message_bytes": "Received message larger than max",
    "limit: answer > max_send_message_bytes": "max_send_message_bytes",
    "limit: tokens > run_max_tokens": "",
    "limit: inline weights > run_max_inline_bytes": "",
    "limit: kept layer > layer_budget_mib": "layer budget",
    "limit: Watch burst > max_concurrent_rpcs": "Concurrent RPC limit",
    "limit: ConvertWeights burst > max_concurrent_convert": "max_concurrent_convert",
}
CONCURRENCY_MESSAGE = "Concurrent RPC limit"
#: What a refusal by the per-method convert limit says (service/api/interceptors/limits.py).
CONVERT_LIMIT_MESSAGE = "concurrent calls (setting max_concurrent_convert)"


# ---------------------------------------------------------------------------------------
# Bookkeeping


@dataclass
class Refusal:
    """A RESOURCE_EXHAUSTED on a call that did not provoke a limit itself."""

    method: str
    start: float
    end: float
    details: str


@dataclass
class Tally:
    measure_from: float = 0.0
    calls: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    codes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    failures: list[dict[str, Any]] = field(default_factory=list)
    failure_count: int = 0
    refusals: list[Refusal] = field(default_factory=list)
    bursts: list[tuple[float, float]] = field(default_factory=list)
    convert_bursts: list[tuple[float, float]] = field(default_factory=list)

    def ok(self, method: str, start: float, end: float) -> None:
        self.calls += 1
        self.codes[method]["OK"] += 1
        if start >= self.measure_from:
            self.latencies[method].append(end - start)

    def fail(self, method: str, code: str, detail: str) -> None:
        self.calls += 1
        self.codes[method][code] += 1
        self.failure_count += 1
        if len(self.failures) < 40:
            self.failures.append({"method": method, "code": code, "detail": detail[:300]})

    def refused(self, method: str, start: float, end: float, details: str) -> None:
        """Judged at the end, once every burst window is known."""
        self.calls += 1
        self.codes[method]["RESOURCE_EXHAUSTED"] += 1
        self.refusals.append(Refusal(method, start, end, details))

    def judge_refusals(self, grace: float = 1.0) -> dict[str, int]:
        """Refusals by the concurrent-RPC limit during a burst are provoked; any other is a
        failure. Returns the provoked ones by method."""
        collateral: Counter[str] = Counter()
        for refusal in self.refusals:
            during = any(
                refusal.start <= end + grace and refusal.end >= start - grace
                for start, end in self.bursts
            )
            during_convert = any(
                refusal.start <= end + grace and refusal.end >= start - grace
                for start, end in self.convert_bursts
            )
            by_burst = during and CONCURRENCY_MESSAGE in refusal.details
            by_convert_burst = (
                during_convert
                and refusal.method.startswith("ConvertWeights")
                and CONVERT_LIMIT_MESSAGE in refusal.details
            )
            if by_burst or by_convert_burst:
                collateral[refusal.method] += 1
            else:
                self.failure_count += 1
                if len(self.failures) < 40:
                    self.failures.append(
                        {
                            "method": refusal.method,
                            "code": "RESOURCE_EXHAUSTED",
                            "detail": "not at a provoked limit: " + refusal.details[:300],
                        }
                    )
        return dict(collateral)


class WrongAnswerError(Exception):
    """The call succeeded but its answer is not the right one."""


class CallFailedError(Exception):
    """A stream call's status as the server sent it (see `stream_call`)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


#: What grpc.aio's client reports when a write of a client stream fails because the server
#: has already ended the call (see `stream_call`).
LOST_STATUS = "Internal error from Core"


class _PendingError(Exception):
    pass


def _now(coroutine: Any) -> Any:
    """The value of a call accessor that is ready (a coroutine that does not wait)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise _PendingError


def observed_report() -> bytes:
    """One ReportDecisions request: a decision as the vLLM plugin reports it, the oracle's own
    answer standing in for vLLM's (the soak has no vLLM)."""
    spec = {
        "hf_quantization_config": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": True,
        },
        "layer": {"num_experts": 8, "top_k": 2, "hidden_size": 1024, "intermediate_size": 512},
        "platform": "h100",
    }
    decision = select(spec)
    verdicts = {
        "selected": observed_pb2.OBSERVED_VERDICT_SELECTED,
        "rejected": observed_pb2.OBSERVED_VERDICT_REJECTED,
        "not_reached": observed_pb2.OBSERVED_VERDICT_NOT_REACHED,
    }
    return observed_pb2.ReportDecisionsRequest(
        process=observed_pb2.ReportingProcess(host="soak", vllm_version="0.33.0"),
        decisions=[
            observed_pb2.ObservedDecision(
                layer_name="model.layers.0.mlp.experts",
                layer_count=1,
                moe_method=decision.moe_method,
                integration=decision.quantization,
                deployment_json=json.dumps(spec),
                backend=decision.backend or "",
                experts_class=decision.experts_class or "",
                candidates=[
                    observed_pb2.ObservedCandidate(
                        backend=c.backend, verdict=verdicts[c.verdict], reason=c.reason
                    )
                    for c in decision.candidates
                ],
            )
        ],
    ).SerializeToString()


async def stream_call(
    multi: Any, messages: list[bytes], timeout: float, lost: Counter[str]
) -> list[bytes]:
    """A ConvertWeights call; its answers, or CallFailedError with the server's status.

    When the server ends a client stream early (a refusal at a limit, a bad chunk) while a
    write of ours is in flight, grpc.aio's client fails that write and may report INTERNAL
    "Internal error from Core" instead of the server's status (the forwarder in
    service/server/forward.py works around the same thing). The server's status is the first
    one the call got (kept by a done callback) or arrives just after; `lost` counts how
    often the library's report had to be replaced."""
    call = multi(iter(messages), timeout=timeout)
    first: list[tuple[grpc.StatusCode, str]] = []

    def done(finished: Any) -> None:
        with contextlib.suppress(_PendingError):
            first.append((_now(finished.code()), _now(finished.details()) or ""))

    call.add_done_callback(done)
    try:
        return [raw async for raw in call]
    except grpc.aio.AioRpcError as error:
        code, details = error.code(), error.details() or ""
        if code is not grpc.StatusCode.INTERNAL or LOST_STATUS not in details:
            raise CallFailedError(code, details) from None
        if first and first[0][0] is not grpc.StatusCode.INTERNAL:
            code, details = first[0]
        for _ in range(40):
            if code is not grpc.StatusCode.INTERNAL:
                break
            await asyncio.sleep(0.025)
            code, details = await call.code(), await call.details() or ""
        lost["recovered" if code is not grpc.StatusCode.INTERNAL else "not recovered"] += 1
        raise CallFailedError(code, details) from None


# ---------------------------------------------------------------------------------------
# The server and its processes


def start_server(workdir: Path, extra: list[str]) -> tuple[subprocess.Popen[str], str, Path]:
    log = workdir / "server.log"
    command = serve_command(
        "--log-level",
        "INFO",
        "--grace-s",
        "5",
        "--data-root",
        str(workdir / "root"),
        "--segment-dir",
        str(workdir / "segments"),
        *(f"--{name.replace('_', '-')}={value}" for name, value in LIMITS.items()),
        *extra,
    )
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = listening(line)
    if match is None:
        process.kill()
        process.wait()
        raise SystemExit(f"server did not start: {line!r}\n{log.read_text()[-3000:]}")
    return process, match.group(1), log


def _proc_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    return children


def process_tree(root: int) -> dict[int, str]:
    """pid -> role ("server", "worker", "replica", "other") of `root` and its descendants."""
    children = _proc_children()
    roles: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if pid == root:
            roles[pid] = "server"
        elif "service.worker" in cmdline:
            roles[pid] = "worker"
        elif "service.server.replica" in cmdline:
            roles[pid] = "replica"
        else:
            roles[pid] = "other"
        todo.extend(children.get(pid, ()))
    return roles


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def sample(root: int, segments: Path) -> dict[str, Any]:
    """RSS (MiB) and open fds per role, and the tensor segments present."""
    out: dict[str, Any] = {"t": time.monotonic(), "rss_mib": {}, "anon_mib": {}, "fds": {}}
    for pid, role in process_tree(root).items():
        try:
            rss = _status_kib(pid, "VmRSS") / 1024
            anon = _status_kib(pid, "RssAnon") / 1024
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        out["rss_mib"][role] = out["rss_mib"].get(role, 0.0) + rss
        out["anon_mib"][role] = out["anon_mib"].get(role, 0.0) + anon
        out["fds"][role] = out["fds"].get(role, 0) + fds
    for key in ("rss_mib", "anon_mib", "fds"):
        out[key]["total"] = sum(out[key].values())
    out["segments"] = sum(1 for p in segments.rglob("*") if p.is_file())
    return out


# ---------------------------------------------------------------------------------------
# What the clients send (built once, before the clock starts)


def _wire(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[TensorSpec, memoryview]]:
    return {
        name: (
            TensorSpec.of(name, FROM_TORCH[str(t.dtype).removeprefix("torch.")], t.shape),
            memoryview(tensor_bytes(t)),
        )
        for name, t in tensors.items()
    }


def _checkpoint(experts: int, hidden: int, intermediate: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    layer = random_layer(
        experts, hidden, intermediate, bits=4, group_size=32, symmetric=True, generator=generator
    )
    return write_checkpoint(GPTQ, layer, SourceQuantization(4, 32), naming="mixtral")


def _layer_json(experts: int = E, hidden: int = H, intermediate: int = I) -> str:
    layer = {
        "num_experts": experts,
        "top_k": TOP_K,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
    }
    return json.dumps({"hf_quantization_config": QUANT, "layer": layer})


def convert_stream(
    tensors: dict[str, tuple[TensorSpec, memoryview]], chunk: int, **header: Any
) -> list[bytes]:
    head = header_for(deployment_json=header.pop("spec", None) or _layer_json(), **header)
    return [m.SerializeToString() for m in tensor_requests(head, tensors, chunk)]


#: Deployments for SelectBackend: quantization x shape x preset x forced backend.
QUANTIZATIONS: list[dict[str, Any]] = [
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
    {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                },
            }
        },
        "ignore": ["lm_head"],
    },
]
SHAPES = [(60, 4, 2048, 1408), (8, 2, 4096, 14336), (64, 6, 2048, 1408), (128, 8, 2048, 768)]
PRESETS = ["a100", "h100", "h200", "l4", "l40s", "b200", "mi300x", "a10", "rtx5090", "cpu"]
FORCED = ["auto", "marlin", "triton"]


def selection_pool(limit: int, rng: random.Random) -> list[tuple[bytes, dict[str, Any]]]:
    """(request bytes, the library's answer) for deployments the library decides; requests
    vLLM would refuse are left out, so every SelectBackend answer here must be OK."""
    pool: list[tuple[bytes, dict[str, Any]]] = []
    combos = [(q, s, p, f) for q in QUANTIZATIONS for s in SHAPES for p in PRESETS for f in FORCED]
    rng.shuffle(combos)
    for index, (quant, (experts, top_k, hidden, inter), preset, forced) in enumerate(combos):
        if len(pool) >= limit:
            break
        spec = {
            "hf_quantization_config": quant,
            "layer": {
                "num_experts": experts,
                "top_k": top_k,
                "hidden_size": hidden,
                "intermediate_size": inter,
            },
            "platform": preset,
            "moe_backend": forced,
        }
        try:
            expected = select(spec).to_json()
        except (OracleError, InvalidSpecError):
            continue
        if index % 4 == 0:
            # The same deployment as a model's config.json, the platform in the request.
            config = {
                "model_type": "mixtral",
                "num_local_experts": experts,
                "num_experts_per_tok": top_k,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "quantization_config": quant,
            }
            request = pb.SelectBackendRequest()
            request.model_config.config_json = json.dumps(config)
            request.model_config.moe_backend = forced
            request.platform.preset = preset
            local = {k: v for k, v in spec.items() if k != "layer"}
            local["layer"] = {**spec["layer"], "name": "model.layers.0.block_sparse_moe.experts"}
            try:
                expected = select(local).to_json()
            except (OracleError, InvalidSpecError):
                continue
        else:
            request = pb.SelectBackendRequest(spec_json=json.dumps(spec))
        pool.append((request.SerializeToString(), expected))
    return pool


@dataclass
class Payloads:
    selections: list[tuple[bytes, dict[str, Any]]]
    converts: list[tuple[str, list[bytes], bool]]  # (target, stream, keep_loaded)
    inline_run: list[bytes]
    run_inputs: list[tuple[torch.Tensor, torch.Tensor, int]]  # hidden, logits, tokens
    probes: dict[str, Any]
    small: dict[str, torch.Tensor]


def build_payloads(rng: random.Random, pool_size: int) -> Payloads:
    small = _checkpoint(E, H, I, seed=1)
    wire = _wire(small)
    converts: list[tuple[str, list[bytes], bool]] = []
    for target in ("TRITON", "EMULATION", "MARLIN"):
        for chunk in (16 * 1024, 128 * 1024):
            for keep in (False, True) if target != "MARLIN" else (False,):
                stream = convert_stream(
                    wire, chunk, backend=target, keep_loaded=keep, return_tensors=not keep
                )
                converts.append((target, stream, keep))
    spec = deployment_pb(QUANT, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I)
    run_inputs = []
    generator = torch.Generator().manual_seed(2)
    for tokens in (1, 2, 7, 16, 33, 64, 128, 256):
        hidden = torch.randn(tokens, H, generator=generator).to(torch.bfloat16)
        run_inputs.append((hidden, torch.randn(tokens, E, generator=generator), tokens))
    inline_run = [
        run_request(
            h, inline=(spec, small), router_logits=g, backend="EMULATION"
        ).SerializeToString()
        for h, g, _ in run_inputs[:4]
    ]
    # The probes.
    huge = {"hf_quantization_config": QUANT, "layer": json.loads(_layer_json())["layer"]}
    huge["layer"]["name"] = "x" * (LIMITS["max_receive_message_bytes"] + 1024)
    oversize_select = pb.SelectBackendRequest(spec_json=json.dumps(huge)).SerializeToString()
    stream = convert_stream(wire, 64 * 1024, backend="EMULATION")
    big_chunk = pb.ConvertWeightsRequest(
        chunk=tensor_pb2.TensorChunk(
            name=next(iter(small)), offset=0, data=bytes(LIMITS["max_receive_message_bytes"] + 1)
        )
    ).SerializeToString()
    # After a complete tensor: what the server received so far is a consistent prefix.
    oversize_stream = [*stream[:3], big_chunk, *stream[3:]]
    padded = {**small, "pad": torch.zeros(LIMITS["run_max_inline_bytes"], dtype=torch.uint8)}
    logits_of = torch.Generator().manual_seed(3)
    too_many = LIMITS["run_max_tokens"] + 1
    answer_tokens = LIMITS["run_max_tokens"]  # its output alone is max_send_message_bytes
    assert answer_tokens * H * 2 >= LIMITS["max_send_message_bytes"]
    experts, hidden, inter = BIG
    probes = {
        "oversize_select": oversize_select,
        "oversize_stream": oversize_stream,
        "inline_too_big": run_request(
            run_inputs[0][0], inline=(spec, padded), router_logits=run_inputs[0][1]
        ).SerializeToString(),
        "too_many_tokens": (
            torch.zeros(too_many, H, dtype=torch.bfloat16),
            torch.randn(too_many, E, generator=logits_of),
        ),
        "big_answer": (
            torch.zeros(answer_tokens, H, dtype=torch.bfloat16),
            torch.randn(answer_tokens, E, generator=logits_of),
        ),
        "over_budget": convert_stream(
            _wire(_checkpoint(experts, hidden, inter, seed=4)),
            512 * 1024,
            spec=_layer_json(experts, hidden, inter),
            backend="EMULATION",
            keep_loaded=True,
            return_tensors=False,
        ),
    }
    return Payloads(
        selections=selection_pool(pool_size, rng),
        converts=converts,
        inline_run=inline_run,
        run_inputs=run_inputs,
        probes=probes,
        small=small,
    )


# ---------------------------------------------------------------------------------------
# The clients


class Soak:
    def __init__(
        self, args: argparse.Namespace, target: str, workdir: Path, payloads: Payloads
    ) -> None:
        self.args = args
        self.target = target
        self.workdir = workdir
        self.payloads = payloads
        self.tally = Tally()
        self.rng = random.Random(args.seed)
        self.stop_at = 0.0
        self.resident: dict[str, str] = {}  # layer id -> backend to run it with
        self.run_requests: list[tuple[bytes, int, str]] = []
        self.channels: list[grpc.aio.Channel] = []
        self.seen_selections: dict[int, bytes] = {}
        self.checkpoint_runs = 0
        self.lost_status: Counter[str] = Counter()

    # -- plumbing

    def channel(self) -> grpc.aio.Channel:
        big = 64 * MIB
        options = [
            ("grpc.max_receive_message_length", big),
            ("grpc.max_send_message_length", big),
            ("grpc.use_local_subchannel_pool", 1),  # a connection of its own
        ]
        channel = grpc.aio.insecure_channel(self.target, options=options)
        self.channels.append(channel)
        return channel

    def running(self) -> bool:
        return time.monotonic() < self.stop_at and self.tally.calls < self.args.max_calls

    async def timed(
        self,
        method: str,
        call: Callable[[], Awaitable[Any]],
        check: Callable[[Any], None] | None = None,
        *,
        probe: bool = False,
    ) -> Any:
        """One call, tallied: OK (checked), RESOURCE_EXHAUSTED (judged later), else failed."""
        start = time.monotonic()
        try:
            result = await call()
        except (grpc.aio.AioRpcError, CallFailedError) as error:
            end = time.monotonic()
            if isinstance(error, CallFailedError):
                code, details = error.code.name, error.details
            else:
                code, details = error.code().name, error.details() or ""
            if probe:
                wanted = PROBES[method]
                if code == "RESOURCE_EXHAUSTED" and wanted.lower() in details.lower():
                    self.tally.ok(method, start, end)
                elif code == "RESOURCE_EXHAUSTED" and CONCURRENCY_MESSAGE in details:
                    self.tally.refused(method, start, end, details)  # a burst's, not its own
                else:
                    self.tally.fail(method, code, details)
            elif code == "RESOURCE_EXHAUSTED":
                self.tally.refused(method, start, end, details)
            else:
                self.tally.fail(method, code, details)
            return None
        except (TimeoutError, OSError, ValueError) as error:
            self.tally.fail(method, "CLIENT_ERROR", f"{type(error).__name__}: {error}")
            return None
        end = time.monotonic()
        if probe:
            self.tally.fail(method, "OK", "the limit was not enforced")
            return None
        try:
            if check is not None:
                check(result)
        except Exception as wrong:  # any flaw in the answer is a finding
            self.tally.fail(method, "WRONG_ANSWER", f"{type(wrong).__name__}: {wrong}")
            return None
        self.tally.ok(method, start, end)
        return result

    # -- setup: the resident layers RunMoE uses

    async def keep_layer(self, channel: grpc.aio.Channel, stream: list[bytes]) -> str:
        call = channel.stream_stream(SERVICE + "ConvertWeights")
        summary = None
        async for raw in call(iter(stream), timeout=120):
            message = pb.ConvertWeightsResponse.FromString(raw)
            if message.WhichOneof("message") == "summary":
                summary = message.summary
        if summary is None or not summary.layer_id:
            raise SystemExit("setup: a kept layer came back without an id")
        return str(summary.layer_id)

    async def setup(self) -> None:
        channel = self.channel()
        wire = _wire(self.payloads.small)
        for backend, run_with in (("EMULATION", "EMULATION"), ("TRITON", "EMULATION")):
            stream = convert_stream(
                wire, 64 * 1024, backend=backend, keep_loaded=True, return_tensors=False
            )
            self.resident[await self.keep_layer(channel, stream)] = run_with
        for layer_id, backend in self.resident.items():
            for hidden, logits, tokens in self.payloads.run_inputs:
                if tokens % 2:
                    weights, ids = topk_route(logits, TOP_K)
                    request = run_request(
                        hidden, layer_id=layer_id, topk=(ids, weights), backend=backend
                    )
                else:
                    request = run_request(
                        hidden, layer_id=layer_id, router_logits=logits, backend=backend
                    )
                self.run_requests.append((request.SerializeToString(), tokens, backend))

    # -- the kinds of client

    async def select_client(self) -> None:
        call = self.channel().unary_unary(SERVICE + "SelectBackend")
        pool = self.payloads.selections
        while self.running():
            index = self.rng.randrange(len(pool))
            request, expected = pool[index]

            def check(raw: bytes, index: int = index, expected: dict[str, Any] = expected) -> None:
                first = self.seen_selections.get(index)
                if first is not None and raw == first:
                    return
                answer = codec.select_response_to_json(pb.SelectBackendResponse.FromString(raw))
                if answer != expected:
                    raise WrongAnswerError(f"selection {index} differs from the library's")
                self.seen_selections.setdefault(index, raw)

            await self.timed("SelectBackend", lambda r=request: call(r, timeout=30), check)

    async def convert_client(self) -> None:
        channel = self.channel()
        call = channel.stream_stream(SERVICE + "ConvertWeights")
        run = channel.unary_unary(SERVICE + "RunMoE")
        listing = channel.unary_unary(SERVICE + "ListLayers")
        unload = channel.unary_unary(SERVICE + "UnloadLayer")
        turn = 0
        while self.running():
            # Every other conversion keeps its layer, so even a short run unloads some.
            turn += 1
            kept = [c for c in self.payloads.converts if c[2] == (turn % 2 == 1)]
            target, stream, keep = self.rng.choice(kept)

            async def convert(stream: list[bytes] = stream) -> list[pb.ConvertWeightsResponse]:
                answers = await stream_call(call, stream, 60, self.lost_status)
                return [pb.ConvertWeightsResponse.FromString(raw) for raw in answers]

            def check(out: list[Any], target: str = target, keep: bool = keep) -> None:
                check_conversion(out, target, keep)

            out = await self.timed("ConvertWeights (inline)", convert, check)
            if not keep or not out:
                continue
            await self.use_kept(run, listing, unload, out[-1].summary.layer_id)

    async def use_kept(self, run: Any, listing: Any, unload: Any, layer_id: str) -> None:
        """A layer just kept: run it, see it listed, unload it."""
        hidden, logits, tokens = self.rng.choice(self.payloads.run_inputs)
        request = run_request(
            hidden, layer_id=layer_id, router_logits=logits, backend="EMULATION"
        ).SerializeToString()
        await self.timed(
            "RunMoE (layer)",
            lambda: run(request, timeout=60),
            lambda raw: check_run(raw, tokens, "EMULATION"),
        )

        def listed(raw: bytes) -> None:
            ids = {x.layer_id for x in pb.ListLayersResponse.FromString(raw).layers}
            if layer_id not in ids or not set(self.resident) <= ids:
                raise WrongAnswerError("ListLayers lacks a kept layer")

        await self.timed("ListLayers", lambda: listing(b"", timeout=30), listed)
        request_unload = pb.UnloadLayerRequest(layer_id=layer_id).SerializeToString()

        def freed(raw: bytes) -> None:
            if pb.UnloadLayerResponse.FromString(raw).freed_bytes <= 0:
                raise WrongAnswerError("UnloadLayer freed nothing")

        # A refusal (a Watch burst holds every slot) is retried, as any client would: the
        # layer is ours to drop.
        for _ in range(50):
            if await self.timed("UnloadLayer", lambda: unload(request_unload, timeout=30), freed):
                break
            await asyncio.sleep(0.2)

    async def checkpoint_client(self) -> None:
        call = self.channel().stream_stream(SERVICE + "ConvertWeights")
        root = self.workdir / "root"
        choices = [("TRITON", ""), ("EMULATION", ""), ("MARLIN", ""), ("", "a100")]
        while self.running():
            self.checkpoint_runs += 1
            output = f"out/{self.checkpoint_runs}"
            backend, preset = choices[self.checkpoint_runs % len(choices)]
            header = header_for(
                backend=backend, platform_preset=preset or None, checkpoint=("model", output)
            )
            request = pb.ConvertWeightsRequest(header=header).SerializeToString()
            resume = self.checkpoint_runs % 3 == 0

            async def convert(request: bytes = request) -> list[pb.ConvertWeightsResponse]:
                answers = await stream_call(call, [request], 120, self.lost_status)
                return [pb.ConvertWeightsResponse.FromString(raw) for raw in answers]

            def check(out: list[Any], resumed: bool = False) -> None:
                summary = out[-1].summary if out else None
                if summary is None or out[-1].WhichOneof("message") != "summary":
                    raise WrongAnswerError("no summary")
                done = (summary.layers_converted, summary.layers_skipped)
                if done != ((0, 2) if resumed else (2, 0)):
                    raise WrongAnswerError(f"layers converted/skipped {done}")
                if not (root / summary.manifest_path).is_file():
                    raise WrongAnswerError("no manifest")
                if not any(m.WhichOneof("message") == "progress" for m in out):
                    raise WrongAnswerError("no progress")

            ok = await self.timed("ConvertWeights (checkpoint)", convert, check)
            if ok and resume and self.running():
                await self.timed(
                    "ConvertWeights (checkpoint)",
                    convert,
                    lambda out: check(out, resumed=True),
                )
            shutil.rmtree(root / output, ignore_errors=True)

    async def run_client(self) -> None:
        call = self.channel().unary_unary(SERVICE + "RunMoE")
        while self.running():
            if self.rng.random() < 0.15:
                request = self.rng.choice(self.payloads.inline_run)
                tokens = pb.RunMoERequest.FromString(request).hidden_states.shape[0]
                method = "RunMoE (inline)"
                backend = "EMULATION"
            else:
                request, tokens, backend = self.rng.choice(self.run_requests)
                method = "RunMoE (layer)"
            await self.timed(
                method,
                lambda r=request: call(r, timeout=60),
                lambda raw, t=tokens, b=backend: check_run(raw, t, b),
            )

    async def listing_client(self) -> None:
        channel = self.channel()
        empty = b""

        def platform(raw: bytes) -> None:
            if (
                pb.GetPlatformResponse.FromString(raw).worker.platform.device
                != platform_pb2.DEVICE_KIND_CPU
            ):
                raise WrongAnswerError("GetPlatform: not the CPU worker")

        def presets(raw: bytes) -> None:
            if len(pb.ListPlatformPresetsResponse.FromString(raw).presets) < 10:
                raise WrongAnswerError("ListPlatformPresets: too few")

        def rulesets(raw: bytes) -> None:
            if not any(r.is_default for r in pb.ListRulesetsResponse.FromString(raw).rulesets):
                raise WrongAnswerError("ListRulesets: no default")

        def workers(raw: bytes) -> None:
            answer = pb.ListWorkersResponse.FromString(raw)
            if not answer.ready or [w.restarts for w in answer.workers] != [0]:
                raise WrongAnswerError("ListWorkers: not ready, or the worker restarted")

        def layers(raw: bytes) -> None:
            ids = {x.layer_id for x in pb.ListLayersResponse.FromString(raw).layers}
            if not set(self.resident) <= ids:
                raise WrongAnswerError("ListLayers: a resident layer is gone")

        names = list(RULESETS)
        chain = upgrade_chain(names[0], names[-1])
        expected_diff = upgrade(DIFF_SPEC, chain[0], chain[-1]).to_json()
        diff_request = pb.DiffRulesetsRequest(spec_json=json.dumps(DIFF_SPEC), rulesets=chain)

        def diff(raw: bytes) -> None:
            response = pb.DiffRulesetsResponse.FromString(raw)
            if upgrade_codec.upgrade_response_to_json(response) != expected_diff:
                raise WrongAnswerError("DiffRulesets: not the library's diff")

        gpus, matrix_rulesets = ["a100", "h200"], [names[0], names[-1]]
        matrix_request = pb.SelectMatrixRequest(
            models=[pb.MatrixModel(label="diff-spec", spec_json=json.dumps(DIFF_SPEC))],
            gpus=gpus,
            rulesets=matrix_rulesets,
        )
        expected_cells = [
            (ruleset, gpu, select({**DIFF_SPEC, "platform": gpu, "ruleset": ruleset}).backend)
            for ruleset in matrix_rulesets
            for gpu in gpus
        ]

        def matrix(raw: bytes) -> None:
            cells = pb.SelectMatrixResponse.FromString(raw).cells
            if [(c.ruleset, c.gpu, c.backend or None) for c in cells] != expected_cells:
                raise WrongAnswerError("SelectMatrix: not the library's cells")

        def reported(raw: bytes) -> None:
            if observed_pb2.ReportDecisionsResponse.FromString(raw).accepted != 1:
                raise WrongAnswerError("ReportDecisions: the decision was not accepted")

        def observed(raw: bytes) -> None:
            # The soak's own report may not have been made yet: the listing only parses.
            observed_pb2.ListObservedDecisionsResponse.FromString(raw)

        rows: list[tuple[str, bytes, Callable[[bytes], None]]] = [
            ("ReportDecisions", observed_report(), reported),
            ("ListObservedDecisions", empty, observed),
            ("GetPlatform", empty, platform),
            ("ListPlatformPresets", empty, presets),
            ("ListRulesets", empty, rulesets),
            ("DiffRulesets", diff_request.SerializeToString(), diff),
            ("SelectMatrix", matrix_request.SerializeToString(), matrix),
            ("ListWorkers", empty, workers),
            ("ListLayers", empty, layers),
        ]
        calls = {name: channel.unary_unary(SERVICE + name) for name, _, _ in rows}
        while self.running():
            name, body, check = self.rng.choice(rows)
            await self.timed(name, lambda n=name, b=body: calls[n](b, timeout=30), check)

    async def health_client(self) -> None:
        call = self.channel().unary_unary(HEALTH + "Check")
        requests = [
            health_pb2.HealthCheckRequest(service=s).SerializeToString() for s in ("", READINESS)
        ]

        def serving(raw: bytes) -> None:
            status = health_pb2.HealthCheckResponse.FromString(raw).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                raise WrongAnswerError(f"health status {status}")

        while self.running():
            request = self.rng.choice(requests)
            await self.timed("Health.Check", lambda r=request: call(r, timeout=10), serving)
            await asyncio.sleep(0.01)

    async def prober(self) -> None:
        channel = self.channel()
        select_call = channel.unary_unary(SERVICE + "SelectBackend")
        convert_call = channel.stream_stream(SERVICE + "ConvertWeights")
        run = channel.unary_unary(SERVICE + "RunMoE")
        probes = self.payloads.probes
        layer_id = next(iter(self.resident))

        async def stream(messages: list[bytes]) -> list[bytes]:
            return await stream_call(convert_call, messages, 60, self.lost_status)

        def run_probe(pair: tuple[torch.Tensor, torch.Tensor]) -> bytes:
            return run_request(
                pair[0], layer_id=layer_id, router_logits=pair[1], backend="EMULATION"
            ).SerializeToString()

        too_many, big_answer = run_probe(probes["too_many_tokens"]), run_probe(probes["big_answer"])
        steps: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            (
                "limit: request > max_receive_message_bytes",
                lambda: select_call(probes["oversize_select"], timeout=30),
            ),
            (
                "limit: stream chunk > max_receive_message_bytes",
                lambda: stream(probes["oversize_stream"]),
            ),
            ("limit: answer > max_send_message_bytes", lambda: run(big_answer, timeout=60)),
            ("limit: tokens > run_max_tokens", lambda: run(too_many, timeout=60)),
            (
                "limit: inline weights > run_max_inline_bytes",
                lambda: run(probes["inline_too_big"], timeout=60),
            ),
            ("limit: kept layer > layer_budget_mib", lambda: stream(probes["over_budget"])),
        ]
        turn = 0
        # At least one round, however short the run: every limit is provoked.
        while self.running() or turn <= len(steps):
            if turn % (len(steps) + 1) == len(steps):
                await self.burst()
                await self.convert_burst()
            else:
                name, step = steps[turn % (len(steps) + 1)]
                await self.timed(name, step, probe=True)
            turn += 1
            await asyncio.sleep(self.args.probe_pause)

    async def burst(self) -> None:
        """Hold `limit + extra` health Watch streams at once: at most `limit` RPCs may run,
        so at least `extra` of them must be refused; the accepted ones are cancelled once
        every stream has had its answer."""
        method = "limit: Watch burst > max_concurrent_rpcs"
        limit = LIMITS["max_concurrent_rpcs"]
        extra = 16
        channels = [self.channel() for _ in range(4)]
        request = health_pb2.HealthCheckRequest(service="").SerializeToString()
        watches = [
            channels[i % len(channels)].unary_stream(HEALTH + "Watch")(request, timeout=30)
            for i in range(limit + extra)
        ]

        async def first(call: Any) -> str:
            try:
                await call.read()
                return "OK"
            except grpc.aio.AioRpcError as error:
                if CONCURRENCY_MESSAGE in (error.details() or ""):
                    return error.code().name
                return f"{error.code().name}: {error.details()}"

        start = time.monotonic()
        outcomes = await asyncio.gather(*(first(call) for call in watches))
        for call in watches:
            call.cancel()
        end = time.monotonic()
        self.tally.bursts.append((start, end))
        refused = outcomes.count("RESOURCE_EXHAUSTED")
        odd = [o for o in outcomes if o not in ("OK", "RESOURCE_EXHAUSTED")]
        if odd:
            self.tally.fail(method, "UNEXPECTED", "; ".join(sorted(set(odd)))[:300])
        elif refused < extra:
            self.tally.fail(method, "OK", f"only {refused} of {limit + extra} refused")
        else:
            self.tally.ok(method, start, end)
        for channel in channels:
            await channel.close()
            self.channels.remove(channel)
        await asyncio.sleep(0.2)

    async def convert_burst(self) -> None:
        """Hold `limit + extra` ConvertWeights streams that send nothing (each holds its
        slot until it ends): at least `extra` must be refused at once by the per-method
        limit, which names itself; then every stream is cancelled (no slot may leak: the
        next burst finds the limit free again)."""
        method = "limit: ConvertWeights burst > max_concurrent_convert"
        limit = LIMITS["max_concurrent_convert"]
        extra = 4
        channel = self.channel()
        convert = channel.stream_stream(SERVICE + "ConvertWeights")
        start = time.monotonic()
        calls = [convert(timeout=30) for _ in range(limit + extra)]
        tasks = [asyncio.ensure_future(call.code()) for call in calls]
        await asyncio.wait(tasks, timeout=0.5)
        ended = [
            (call, task.result()) for call, task in zip(calls, tasks, strict=True) if task.done()
        ]
        for call in calls:
            call.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        end = time.monotonic()
        self.tally.convert_bursts.append((start, end))
        refused = 0
        odd = []
        for call, code in ended:
            details = await call.details() or ""
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED and CONVERT_LIMIT_MESSAGE in details:
                refused += 1
            else:
                odd.append(f"{code.name}: {details[:120]}")
        if odd:
            self.tally.fail(method, "UNEXPECTED", "; ".join(sorted(set(odd)))[:300])
        elif refused < extra:
            self.tally.fail(method, "OK", f"only {refused} of {limit + extra} refused")
        else:
            self.tally.ok(method, start, end)
        await channel.close()
        self.channels.remove(channel)
        await asyncio.sleep(0.2)


def check_conversion(out: list[pb.ConvertWeightsResponse], target: str, keep: bool) -> None:
    if not out or out[-1].WhichOneof("message") != "summary":
        raise WrongAnswerError("no summary")
    summary = out[-1].summary
    if summary.target_format.backend != target:
        raise WrongAnswerError(f"converted to {summary.target_format.backend}, not {target}")
    if bool(summary.layer_id) != keep:
        raise WrongAnswerError("layer id present iff kept")
    data: dict[str, bytearray] = defaultdict(bytearray)
    headers = {}
    for message in out[:-1]:
        if message.WhichOneof("message") == "tensor":
            headers[message.tensor.name] = convert_codec.tensor_spec(message.tensor)
        elif message.WhichOneof("message") == "chunk":
            data[message.chunk.name] += message.chunk.data
    if keep:
        if headers:
            raise WrongAnswerError("tensors returned for a kept layer without return_tensors")
        return
    if not headers or set(headers) != set(data):
        raise WrongAnswerError("tensor headers and chunks disagree")
    for name, spec in headers.items():
        if hashlib.sha256(data[name]).hexdigest() != spec.sha256:
            raise WrongAnswerError(f"{name}: SHA-256 mismatch")


def check_run(raw: bytes, tokens: int, backend: str) -> None:
    answer = pb.RunMoEResponse.FromString(raw)
    if list(answer.output.shape) != [tokens, H] or answer.backend != backend:
        raise WrongAnswerError(f"output {list(answer.output.shape)} by {answer.backend}")
    if len(answer.output.data) != tokens * H * 2:
        raise WrongAnswerError("output bytes")


# ---------------------------------------------------------------------------------------
# The run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def flatness(
    samples: list[dict[str, Any]], measure_from: float, key: str, role: str
) -> tuple[float, float]:
    """Median of `key`[role] over the first and the last third of the samples taken after
    the warm-up."""
    values = [s[key].get(role, 0) for s in samples if s["t"] >= measure_from]
    third = max(1, len(values) // 3)
    return statistics.median(values[:third]), statistics.median(values[-third:])


async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    root = workdir / "root"
    (workdir / "segments").mkdir(parents=True)
    write_synthetic_checkpoint(
        root / "model",
        SyntheticSpec(num_layers=2, num_experts=E, hidden_size=H, intermediate_size=I, fast=True),
    )
    payloads = build_payloads(rng, args.selection_pool)
    process, target, log = start_server(workdir, args.server_args)
    watchdog = threading.Timer(args.seconds + args.watchdog, _expire, (process,))
    watchdog.daemon = True
    watchdog.start()
    runner = Soak(args, target, workdir, payloads)
    samples: list[dict[str, Any]] = []
    try:
        await wait_ready(target)
        await runner.setup()
        baseline = sample(process.pid, workdir / "segments")
        connections_before = len(runner.channels)
        started = time.monotonic()
        runner.stop_at = started + args.seconds
        runner.tally.measure_from = started + args.warmup

        async def sampler() -> None:
            while time.monotonic() < runner.stop_at and runner.running():
                samples.append(sample(process.pid, workdir / "segments"))
                await asyncio.sleep(args.sample_interval)

        tasks = [asyncio.create_task(sampler())]
        kinds: dict[str, Callable[[], Awaitable[None]]] = {
            "select": runner.select_client,
            "convert": runner.convert_client,
            "checkpoint": runner.checkpoint_client,
            "run": runner.run_client,
            "listing": runner.listing_client,
            "health": runner.health_client,
            "prober": runner.prober,
        }
        for kind, count in args.clients.items():
            tasks += [asyncio.create_task(kinds[kind]()) for _ in range(count)]
        await asyncio.gather(*tasks)
        ended = time.monotonic()
        # Quiet: what is left behind once every call has ended. Idle segments are kept for
        # reuse a little while (a pool) and the worker closes its idle mappings on a sweep,
        # later still on a busy machine: wait, up to --settle seconds, for both to be done
        # (no segment, descriptors back within their bound). A leak never gets there.
        fd_bound = (
            baseline["fds"].get("total", 0)
            + len(runner.channels)
            - connections_before
            + args.fd_slack
        )
        settle = time.monotonic() + args.settle
        after = sample(process.pid, workdir / "segments")
        while (after["segments"] or after["fds"].get("total", 0) > fd_bound) and (
            time.monotonic() < settle
        ):
            await asyncio.sleep(0.25)
            after = sample(process.pid, workdir / "segments")
        final = await final_state(target, set(runner.resident))
        alive = process.poll() is None
    finally:
        for channel in runner.channels:
            await channel.close()
        watchdog.cancel()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return report(
        args,
        runner,
        samples=samples,
        after=after,
        final=final,
        alive=alive,
        started=started,
        ended=ended,
        log=log,
        baseline=baseline,
        connections=len(runner.channels) - connections_before,
    )


def _expire(process: subprocess.Popen[str]) -> None:
    """The soak overran its bound: stop everything, fail."""
    print("soak: watchdog expired, killing the server", file=sys.stderr)
    process.kill()
    os._exit(2)


async def wait_ready(target: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    request = health_pb2.HealthCheckRequest(service=READINESS).SerializeToString()
    async with grpc.aio.insecure_channel(target) as channel:
        check = channel.unary_unary(HEALTH + "Check")
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                raw = await check(request, timeout=5)
                if health_pb2.HealthCheckResponse.FromString(raw).status == 1:
                    return
            await asyncio.sleep(0.1)
    raise SystemExit("the server never became ready")


async def final_state(target: str, resident: set[str]) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        workers = pb.ListWorkersResponse.FromString(
            await channel.unary_unary(SERVICE + "ListWorkers")(b"", timeout=10)
        )
        layers = pb.ListLayersResponse.FromString(
            await channel.unary_unary(SERVICE + "ListLayers")(b"", timeout=10)
        )
        health = health_pb2.HealthCheckResponse.FromString(
            await channel.unary_unary(HEALTH + "Check")(
                health_pb2.HealthCheckRequest(service=READINESS).SerializeToString(), timeout=10
            )
        )
    ids = {x.layer_id for x in layers.layers}
    return {
        "ready": health.status == health_pb2.HealthCheckResponse.SERVING,
        "worker_restarts": sum(w.restarts for w in workers.workers),
        "leftover_layers": sorted(ids - resident),
        "resident_layers_kept": resident <= ids,
    }


def server_errors(log: Path) -> dict[str, int]:
    """Error-level lines of the server's log, by logger and message."""
    found: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("error", "critical"):
            found[f"{entry.get('logger')}: {str(entry.get('msg'))[:90]}"] += 1
    return dict(found)


def report(
    args: argparse.Namespace,
    runner: Soak,
    *,
    samples: list[dict[str, Any]],
    after: dict[str, Any],
    final: dict[str, Any],
    alive: bool,
    started: float,
    ended: float,
    log: Path,
    baseline: dict[str, Any],
    connections: int,
) -> dict[str, Any]:
    tally = runner.tally
    collateral = tally.judge_refusals()
    measured = max(1e-9, ended - tally.measure_from)
    rows = []
    for method in (*METHODS, *PROBES):
        lat = tally.latencies.get(method, [])
        rows.append(
            {
                "method": method,
                "calls": sum(tally.codes[method].values()),
                "measured_ok": len(lat),
                "per_s": round(len(lat) / measured, 2),
                "p50_ms": round(percentile(lat, 0.50) * 1e3, 2),
                "p90_ms": round(percentile(lat, 0.90) * 1e3, 2),
                "p99_ms": round(percentile(lat, 0.99) * 1e3, 2),
                "max_ms": round(max(lat, default=0.0) * 1e3, 2),
                "codes": dict(tally.codes[method]),
                "refused_in_burst": collateral.get(method, 0),
            }
        )
    problems: list[str] = []
    if tally.failure_count:
        problems.append(f"{tally.failure_count} unexpected outcomes")
    for row in rows:
        if row["method"] in PROBES and not row["codes"].get("OK"):
            problems.append(f"{row['method']}: never provoked")
        elif row["method"] not in PROBES and row["measured_ok"] == 0:
            problems.append(f"{row['method']}: no successful call in the measured window")
    memory: dict[str, Any] = {}
    for role in ("server", "worker", "total"):
        # Judged: anonymous RSS, the processes' own heap. VmRSS also counts the shared
        # tensor segments mapped for the calls in flight (or kept idle for reuse), which
        # follow the load; those are checked by the segment count at the end instead.
        first, last = flatness(samples, tally.measure_from, "anon_mib", role)
        rss_first, rss_last = flatness(samples, tally.measure_from, "rss_mib", role)
        allowed = first * (1 + args.rss_tolerance) + args.rss_slack_mib
        memory[role] = {
            "first_mib": round(first, 1),
            "last_mib": round(last, 1),
            "growth_pct": round((last - first) / first * 100, 2) if first else 0.0,
            "rss_first_mib": round(rss_first, 1),
            "rss_last_mib": round(rss_last, 1),
        }
        if role == "total":
            memory[role]["allowed_mib"] = round(allowed, 1)
            if last > allowed:
                problems.append(
                    f"anonymous RSS grew from {first:.1f} to {last:.1f} MiB (> {allowed:.1f})"
                )
    fd_first, fd_last = flatness(samples, tally.measure_from, "fds", "total")
    fds = {
        "baseline": baseline["fds"].get("total", 0),
        "first": fd_first,
        "last": fd_last,
        "after": after["fds"].get("total", 0),
        "connections": connections,
    }
    # Under load the count follows the calls in flight (and any pool of idle segments); a
    # leaked descriptor is one still open once everything is idle again.
    if fds["after"] > fds["baseline"] + connections + args.fd_slack:
        problems.append(
            f"{fds['after']} fds open once idle, against {fds['baseline']} before the load "
            f"+ {connections} client connections"
        )
    if not alive:
        problems.append("the server died")
    if not final["ready"]:
        problems.append("the server is not ready at the end")
    if final["worker_restarts"]:
        problems.append(f"the worker restarted {final['worker_restarts']} times")
    if final["leftover_layers"]:
        problems.append(f"kept layers left behind: {final['leftover_layers']}")
    if not final["resident_layers_kept"]:
        problems.append("a resident layer was evicted")
    if after["segments"]:
        problems.append(f"{after['segments']} tensor segments left behind")
    error_logs = server_errors(log)
    if error_logs:
        problems.append(f"error-level lines in the server's log: {error_logs}")
    leftovers = sorted(str(p) for p in (runner.workdir / "root" / "out").glob("*"))
    if leftovers:
        problems.append(f"outputs left: {leftovers[:3]}")
    peak = {
        "rss_mib": round(max(s["rss_mib"]["total"] for s in samples), 1) if samples else 0,
        "fds": max(s["fds"]["total"] for s in samples) if samples else 0,
        "segments": max(s["segments"] for s in samples) if samples else 0,
    }
    return {
        "command": " ".join(["bench/soak.py", *sys.argv[1:]]),
        "seconds": round(ended - started, 1),
        "warmup_s": args.warmup,
        "clients": args.clients,
        "limits": LIMITS,
        "calls": tally.calls,
        "rows": rows,
        "memory": memory,
        "fds": fds,
        "peak": peak,
        "samples": len(samples),
        "timeline": [
            {
                "t": round(x["t"] - started, 1),
                "rss_mib": {k: round(v, 1) for k, v in x["rss_mib"].items()},
                "anon_mib": {k: round(v, 1) for k, v in x["anon_mib"].items()},
                "fds": x["fds"],
                "segments": x["segments"],
            }
            for x in samples
        ],
        "final": final,
        "server_error_logs": error_logs,
        "client_lost_status": dict(runner.lost_status),
        "failures": tally.failures,
        "problems": problems,
        "passed": not problems,
        "criteria": {
            "rss": f"anonymous RSS (server + worker): last third's median <= first third's "
            f"x {1 + args.rss_tolerance:g} "
            f"+ {args.rss_slack_mib:g} MiB (after {args.warmup:g} s warm-up)",
            "fds": f"once idle (segments and mappings gone, waited for up to {args.settle:g} "
            f"s), <= before the load + the client connections still open + {args.fd_slack}",
            "logs": "no error-level line in the server's log",
        },
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['command']}`: {result['seconds']} s, {result['calls']:,} calls, "
        f"warm-up {result['warmup_s']:g} s; "
        + ("**passed**" if result["passed"] else "**FAILED**: " + "; ".join(result["problems"])),
        "",
        "| method | calls | ok/s | p50 ms | p90 ms | p99 ms | max ms | codes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        codes = ", ".join(f"{k} {v:,}" for k, v in sorted(row["codes"].items()))
        if row["refused_in_burst"]:
            codes += f" ({row['refused_in_burst']} refused during a burst)"
        lines.append(
            f"| {row['method']} | {row['calls']:,} | {row['per_s']} | {row['p50_ms']} | "
            f"{row['p90_ms']} | {row['p99_ms']} | {row['max_ms']} | {codes} |"
        )
    memory, fds = result["memory"], result["fds"]
    lines += [
        "",
        "| process | RSS first third MiB | RSS last third MiB | anonymous RSS first third MiB "
        "| last third MiB | growth |",
        "|---|---|---|---|---|---|",
    ]
    for role, m in memory.items():
        lines.append(
            f"| {role} | {m['rss_first_mib']} | {m['rss_last_mib']} | {m['first_mib']} | "
            f"{m['last_mib']} | {m['growth_pct']} % |"
        )
    lines += [
        "",
        f"Open fds (server + worker): {fds['baseline']} before the load; medians under load "
        f"{fds['first']:g} (first third), {fds['last']:g} (last third); {fds['after']} once "
        f"idle with {fds['connections']} client connections open. Peak: "
        f"{result['peak']['rss_mib']} MiB, {result['peak']['fds']} fds, "
        f"{result['peak']['segments']} segments. Criteria: memory: {result['criteria']['rss']}; "
        f"fds {result['criteria']['fds']}.",
    ]
    if result["client_lost_status"]:
        lost = result["client_lost_status"]
        lines += [
            "",
            f'grpc.aio\'s client reported INTERNAL "{LOST_STATUS}" for a client stream the '
            f"server had ended: {sum(lost.values())} times; the server's own status was "
            f"recovered {lost.get('recovered', 0)} times.",
        ]
    if result["server_error_logs"]:
        logs = "; ".join(f"{k} ({v})" for k, v in result["server_error_logs"].items())
        lines += ["", f"Server error-level log lines: {logs}."]
    if result["failures"]:
        lines += ["", "Unexpected outcomes (first ones):", ""]
        lines += [f"- {f['method']}: {f['code']}: {f['detail']}" for f in result["failures"]]
    return "\n".join(lines) + "\n"


def _clients(text: str) -> dict[str, int]:
    counts = dict(CLIENTS)
    for part in filter(None, text.split(",")):
        kind, _, count = part.partition("=")
        if kind not in CLIENTS:
            raise argparse.ArgumentTypeError(f"unknown client kind {kind!r}")
        counts[kind] = int(count)
    return counts


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the clients run")
    parser.add_argument("--max-calls", type=int, default=5_000_000, help="stop after this many")
    parser.add_argument("--warmup", type=float, default=None, help="unmeasured start (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--selection-pool", type=int, default=400, help="distinct selections")
    parser.add_argument("--probe-pause", type=float, default=0.3, help="seconds between probes")
    parser.add_argument("--sample-interval", type=float, default=0.5, help="RSS/fd sampling (s)")
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--rss-slack-mib", type=float, default=8.0)
    parser.add_argument("--fd-slack", type=int, default=8)
    parser.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="at most this long for idle segments and descriptors to go once the load stops",
    )
    parser.add_argument("--watchdog", type=float, default=180.0, help="seconds past --seconds")
    parser.add_argument("--markdown", type=Path, help="write the tables here")
    parser.add_argument("--json", type=Path, help="write the whole report here")
    parser.add_argument("--workdir", type=Path, help="keep the data root and log here")
    parser.add_argument(
        "--clients",
        type=_clients,
        default=dict(CLIENTS),
        help="clients per kind, e.g. run=6,select=0 (the others keep their defaults: "
        + ", ".join(f"{k}={v}" for k, v in CLIENTS.items())
        + ")",
    )
    parser.add_argument("server_args", nargs="*", help="extra `serve` flags (after --)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.warmup is None:
        args.warmup = min(30.0, max(3.0, args.seconds * 0.15))
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="soak-", dir=args.workdir))
        result = asyncio.run(soak(args, workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="moe-control-soak-") as temp:
            result = asyncio.run(soak(args, Path(temp)))
    text = markdown(result)
    print(text, end="")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
