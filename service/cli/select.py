"""`moe-control select`: what vLLM 0.33 gives a MoE layer, and why, locally or via a server.

Local mode needs nothing but this package: it imports neither grpc nor torch. `--server`
asks a running moe-control server instead (same output, plus the server's platform).
`--policy measured` (with `--server`) also has the serving worker time every backend it runs
on the layer's shape, and prints each token count's fastest backend beside vLLM's choice:
which backend is fastest depends on the shape and the token count, vLLM's priority list
does not look at either.

With `--server`, every question of one command (each JSON Lines spec; a matrix, asked in
one SelectMatrix call, or one SelectBackend per cell of a server without it) goes through
one session (`service.client.channel`): `--timeout` bounds the whole command
(`--wait-ready` included), and UNAVAILABLE answers carrying the server's RetryInfo are
retried. Measuring is slow, so `--policy measured` has a longer default deadline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.cli import matrix
from service.cli.client_flags import add_connection_arguments, connection_from_args
from service.cli.configs import load_model_configs
from service.client.exits import (
    EXIT_BAD_INPUT,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_SELECTION_FAILED,
    EXIT_SERVER_ERROR,
)
from service.dataplane import matrix as fleet
from service.oracle import (
    DEFAULT_RULESET,
    RULESETS,
    InvalidSpecError,
    OracleError,
    SelectionError,
    deployment_from_model_config,
    select,
)
from service.oracle.json_text import NotJSONError, parse_json
from service.oracle.platform import KNOWN_PACKAGES, preset

if TYPE_CHECKING:
    from service.client.channel import Session


#: The whole command's default deadline with --server (a static answer takes milliseconds).
DEFAULT_TIMEOUT_S = 30.0
#: The default with --policy measured: the server's worker times every backend it runs at
#: every token count (seconds each on a CPU worker, the largest counts the slowest).
MEASURED_TIMEOUT_S = 300.0
#: The token counts a server times when the request names none (the server's
#: `service.dataplane.measured.DEFAULT_TOKENS`, which this local tool does not import).
SERVER_DEFAULT_TOKENS = (1, 16, 256, 4096)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "select",
        help="which WNA16 MoE backend vLLM picks, and every other backend's reason",
        description="Answer what vLLM 0.33 selects for a quantized MoE layer. Give "
        "--deployment (a JSON object, or JSON Lines with one spec per line) or --config "
        "(a model's config.json, a model directory, a directory of configs or a Hugging "
        "Face repo id) with a platform (--gpu). Several models or GPUs give a matrix: models "
        "by GPUs, each cell the backend, hazards marked.",
    )
    add_deployment_arguments(
        parser, gpu_help="platform preset, e.g. h100; several (a100,h100) or 'all' give a matrix"
    )
    parser.add_argument(
        "--ruleset",
        help=f"the vLLM release's rules to decide by, comma separated (known: "
        f"{', '.join(sorted(RULESETS))}; default {DEFAULT_RULESET})",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object per deployment")
    output.add_argument("--csv", action="store_true", help="the matrix, one CSV row per cell")
    add_connection_arguments(
        parser,
        default_timeout=DEFAULT_TIMEOUT_S,
        server_help="ask a moe-control server at HOST:PORT instead of answering locally",
    )
    for action in parser._actions:  # one default per policy, resolved in run()
        if action.dest == "timeout":
            action.default = None
            action.help = (
                "seconds the whole command may take with --server, --wait-ready included "
                f"(default {DEFAULT_TIMEOUT_S:g}; {MEASURED_TIMEOUT_S:g} with --policy "
                "measured, which times every backend at each token count and can take a "
                "minute or more)"
            )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="static",
        help="static: vLLM's rules only; measured (needs --server): the serving worker also "
        "times every backend it runs at each token count (cached by the server; a fresh "
        f"measurement can take a minute or more, default --timeout {MEASURED_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--tokens",
        type=_token_counts,
        default=(),
        metavar="N[,N...]",
        help="token counts to time with --policy measured (default: the server's, 1,16,256,4096)",
    )
    parser.add_argument(
        "--refresh", action="store_true", help="with --policy measured: time again, not cached"
    )
    parser.add_argument(
        "--measure-worker", type=int, help="with --policy measured: the worker that times"
    )
    parser.set_defaults(handler=run)


def add_deployment_arguments(parser: argparse.ArgumentParser, *, gpu_help: str) -> None:
    """The deployments a command answers for, and the vLLM flags laid over each: a spec
    file (--deployment) or model configs (--config), the platform (--gpu, --packages,
    --env) and the serving flags (`apply_flags` reads them). `select` and `diff` share
    them, so both read the same deployments the same way."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--deployment", type=Path, help="deployment spec file (JSON or JSONL)")
    source.add_argument(
        "--config",
        action="append",
        metavar="PATH|ORG/NAME[@REV]",
        help="a model's config.json, its directory, a directory of configs, or a Hugging Face "
        "repo id (read through huggingface_hub: its cache, HF_HUB_OFFLINE); repeatable",
    )
    parser.add_argument("--gpu", "--platform", dest="gpu", help=gpu_help)
    parser.add_argument(
        "--packages",
        help=f"installed kernel packages, comma separated ({','.join(KNOWN_PACKAGES)}) or 'none'",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="a VLLM_* flag"
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--data-parallel-size", "-dp", type=int)
    parser.add_argument("--enable-expert-parallel", action="store_true", default=None)
    parser.add_argument("--all2all-backend")
    parser.add_argument("--quantization", "-q", help="vLLM's --quantization")
    parser.add_argument("--moe-backend", help="vLLM's --moe-backend (default auto)")
    parser.add_argument("--enable-lora", action="store_true", default=None)


POLICIES = ("static", "measured")


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("token counts are positive integers")
    return counts


def read_deployments(path: Path) -> Iterator[Any]:
    """One spec from a JSON file, or one per non-empty line of a JSON Lines file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidSpecError.single(str(path), f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InvalidSpecError.single(str(path), f"not UTF-8: {exc.reason}") from None
    try:
        yield parse_json(text, str(path), numbers_at="")
        return
    except NotJSONError:
        pass
    except InvalidSpecError as exc:
        yield exc
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield parse_json(line, f"{path}:{number}", numbers_at="")
        except InvalidSpecError as exc:
            yield exc


def platform_flags(args: argparse.Namespace) -> dict[str, Any]:
    """What --packages and --env lay over a platform (`fleet.lay_over`)."""
    overlay: dict[str, Any] = {}
    if args.packages is not None:
        names = [] if args.packages in ("", "none") else args.packages.split(",")
        overlay["packages"] = [name.strip() for name in names if name.strip()]
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidSpecError.single("--env", f"expected NAME=VALUE, got {item!r}")
        overlay["env"] = {**overlay.get("env", {}), name: value}
    return overlay


def apply_flags(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Command-line flags override (or fill in) the spec's fields."""
    spec = dict(spec)
    if args.gpu or args.packages is not None or args.env:
        platform = spec.get("platform")
        if args.gpu:
            platform = preset(args.gpu, field_name="--gpu").to_json()
        elif isinstance(platform, str):
            platform = preset(platform).to_json()
        if not isinstance(platform, dict):
            raise InvalidSpecError.single("--gpu", "required: a platform preset, e.g. h100")
        spec["platform"] = fleet.lay_over(platform, platform_flags(args))
    parallel = dict(spec.get("parallel") or {})
    for flag, key in (
        ("tensor_parallel_size", "tensor_parallel_size"),
        ("data_parallel_size", "data_parallel_size"),
        ("enable_expert_parallel", "enable_expert_parallel"),
        ("all2all_backend", "all2all_backend"),
    ):
        if getattr(args, flag) is not None:
            parallel[key] = getattr(args, flag)
    if parallel:
        spec["parallel"] = parallel
    if args.quantization is not None:
        spec["quantization"] = args.quantization
    if args.moe_backend is not None:
        spec["moe_backend"] = args.moe_backend
    if args.enable_lora is not None:
        spec["lora"] = args.enable_lora
    return spec


def answer(
    spec: Any, ruleset: str | None = None, *, what_would_change: bool = True
) -> tuple[dict[str, Any], int]:
    """The JSON answer for one spec (its "id" echoed first, what would change the decision
    included unless asked not to) and the exit status it implies."""
    try:
        if isinstance(spec, InvalidSpecError):
            raise spec
        decision = select(spec, ruleset=ruleset, what_would_change=what_would_change)
        result, code = decision.to_json(), EXIT_OK
    except SelectionError as exc:
        result, code = exc.to_json(), EXIT_SELECTION_FAILED
    except InvalidSpecError as exc:
        violations = [{"field": v.field, "description": v.description} for v in exc.violations]
        result, code = {"invalid": violations}, EXIT_BAD_INPUT
    return with_id(spec, result), code


def with_id(spec: Any, result: dict[str, Any]) -> dict[str, Any]:
    """The answer with the spec's "id" first, so JSON Lines answers match their specs."""
    if isinstance(spec, dict) and "id" in spec:
        return {"id": spec["id"], **result}
    return result


def _text(value: Any, missing: str) -> str:
    """A value for the table; None (JSON null) as what it means, never as "None"."""
    return missing if value is None or value == "" else str(value)


def render_platform(platform: dict[str, Any] | None) -> str:
    """The platform an answer was decided for, in one line: preset, device, capability or
    arch, CPU features, the kernel packages it assumes installed and its env flags."""
    if not platform:
        return "unknown"
    parts = [f"preset {platform['preset']}:"] if platform.get("preset") else []
    device = platform.get("device") or "?"
    if platform.get("capability"):
        device += f" {platform['capability']}"
    if platform.get("arch"):
        device += f" ({platform['arch']})"
    if device.startswith("cpu"):
        device += " x86" if platform.get("x86", True) else " non-x86"
        device += " with AMX" if platform.get("amx") else " without AMX"
    parts.append(device)
    packages = platform.get("packages") or []
    parts.append(f"packages: {','.join(packages) if packages else 'none'}")
    env = platform.get("env") or {}
    parts.append(
        "env: " + (" ".join(f"{k}={v}" for k, v in sorted(env.items())) if env else "none")
    )
    if platform.get("name") and platform.get("name") != platform.get("preset"):
        parts.append(f"({platform['name']})")
    return " ".join(parts[:2]) + "  " + "  ".join(parts[2:])


def render_changes(hints: list[dict[str, Any]] | None, backends: list[str]) -> list[str]:
    """ "to get HUMMING: install humming-kernels", one line per smallest change set, and
    which backends no set of at most two changes helps."""
    if hints is None:
        return []
    lines = []
    for hint in hints:
        what = " and ".join(c["text"] for c in hint["changes"])
        goal = "to get" if hint["outcome"] == "selected" else "to make eligible"
        lines.append(f"{goal} {hint['backend']}: {what}")
    helped = {h["backend"] for h in hints}
    stuck = [b for b in backends if b not in helped]
    if stuck:
        lines.append(f"no change of at most two helps: {', '.join(stuck)}")
    return lines


def render_table(result: dict[str, Any]) -> str:
    lines: list[str] = []
    if "invalid" in result:
        lines.append("invalid deployment spec" + (f" {result['id']}:" if "id" in result else ":"))
        lines.extend(f"  {v['field']}: {v['description']}" for v in result["invalid"])
        return "\n".join(lines)
    if "id" in result:
        lines.append(f"id: {result['id']}")
    platform = result.get("platform")
    server = result.get("server_platform")
    own = " (the serving worker's own)" if server and server == platform else ""
    if platform is not None or "ruleset" in result:
        lines.append(f"platform: {render_platform(platform)}{own}")
        lines.append(f"ruleset: {_text(result.get('ruleset'), 'unknown')}")
    error = result.get("error")
    stage = error["stage"] if error else ""
    if error and stage == "server":  # no answer came back: only the transport's error
        return "\n".join([*lines, f"error (server): {error['type']}: {error['message']}"])
    failed = f"- (not built: vLLM failed at stage {stage})"
    lines.append(
        f"quantization: {_text(result.get('quantization'), failed)}"
        f"   moe method: {_text(result.get('moe_method'), failed)}"
    )
    if error:
        lines.append(f"error ({error['stage']}): {error['type']}: {error['message']}")
    elif result.get("backend") is None:
        why = result.get("explanation") or "vLLM builds no WNA16 MoE method for this layer"
        lines.append(f"backend: none ({why})")
    else:
        experts_class = _text(result.get("experts_class"), "-")
        lines.append(f"backend: {result['backend']}   experts class: {experts_class}")
    candidates = result.get("candidates") or []
    if candidates:
        width = max(len(c["backend"]) for c in candidates)
        lines.append(f"{'BACKEND'.ljust(width)}  {'VERDICT'.ljust(11)}  REASON (vLLM's)")
        for c in candidates:
            explanation = c.get("explanation") or ""
            if c.get("reason"):
                reason = f"[{c['reason_code']}] {c['reason']}"
            else:
                reason, explanation = (f"({explanation})" if explanation else ""), ""
            row = f"{c['backend'].ljust(width)}  {c['verdict'].ljust(11)}  {reason}"
            lines.append(row.rstrip())
            if explanation:
                # ours, beside vLLM's reason above it, never instead of it
                lines.append(f"{''.ljust(width)}  {''.ljust(11)}  = {explanation}")
    for hazard in result.get("hazards") or []:
        lines.append(f"hazard {hazard['code']}: {hazard['message']}")
    losers = [c["backend"] for c in candidates if c["verdict"] != "selected"]
    lines.extend(render_changes(result.get("what_would_change"), losers))
    if measured := result.get("measured"):
        lines.extend(render_measured(measured))
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-6:.3g} us"


def render_measured(measured: dict[str, Any]) -> list[str]:
    """The measured table: per token count the fastest backend, vLLM's choice and both
    times, then every backend's time or why it did not run. A missing value prints as "-"
    (or is left out), never as "None"."""
    if measured.get("from_cache"):
        source = "from the server's cache"
    elif measured.get("measure_seconds") is not None:
        source = f"measured now in {measured['measure_seconds']:.2f} s"
    else:
        source = "measured now"
    worker = _text(measured.get("worker_index"), "?")
    device = f" ({measured['device_name']})" if measured.get("device_name") else ""
    lines = [
        f"measured on worker {worker}{device}, {source}",
        f"{'TOKENS':>6}  {'FASTEST':<15}{'TIME':>10}  {'vLLM CHOICE':<15}{'TIME':>10}  SPEEDUP",
    ]
    reasons: dict[str, str] = {}
    for bucket in measured.get("buckets") or []:
        speedup = bucket.get("speedup")
        lines.append(
            f"{_text(bucket.get('tokens'), '-'):>6}  "
            f"{_text(bucket.get('fastest_backend'), '-'):<15}"
            f"{_seconds(bucket.get('fastest_seconds')):>10}  "
            f"{_text(bucket.get('static_backend'), '-'):<15}"
            f"{_seconds(bucket.get('static_seconds')):>10}  "
            + (f"{speedup:.2f}x" if speedup is not None else "-")
        )
        times = []
        for timing in bucket.get("timings") or []:
            backend = _text(timing.get("backend"), "?")
            if timing.get("device_seconds") is not None:
                times.append(f"{backend} {_seconds(timing['device_seconds'])}")
            else:
                reasons.setdefault(backend, timing.get("error") or "did not run")
        if times:
            lines.append(f"{'':>6}  timed: {', '.join(times)}")
    for backend, reason in reasons.items():
        named = reason if reason.startswith(f"{backend}:") else f"{backend}: {reason}"
        lines.append(f"not run: {named}")
    return lines


def measuring_notice(tokens: tuple[int, ...], timeout: float | None, refresh: bool) -> str:
    """The line printed (on stderr) before a measured call: what the server is about to do
    and how long the client waits."""
    from service.kernels.registry import RUNNABLE  # the backends a worker times (no torch)

    counts = ",".join(str(n) for n in tokens or SERVER_DEFAULT_TOKENS)
    which = "" if tokens else " (the server's default)"
    cached = "" if refresh else " unless the server has them cached"
    limit = "no limit" if timeout is None else f"{timeout:g} s"
    return (
        f"measuring {len(RUNNABLE)} backends ({', '.join(RUNNABLE)}) at token counts "
        f"{counts}{which} on the server's worker; this can take a minute or more{cached} "
        f"(--timeout {limit})"
    )


def deadline_message(args: argparse.Namespace) -> str:
    """The one line said when the server did not answer within --timeout."""
    limit = f"{args.timeout:g} s" if args.timeout is not None else "the deadline"
    why = (
        "measuring every backend at each token count took longer"
        if args.policy == "measured"
        else "the server did not answer in time"
    )
    return (
        f"moe-control select: no answer within {limit} (DEADLINE_EXCEEDED): {why}; "
        "allow more with --timeout SECONDS (the whole command's limit)"
    )


class _OutOfTimeError(Exception):
    """The command's deadline passed: every later call would fail the same way."""


class _MatrixFailedError(Exception):
    """The server refused the whole matrix: its error, in the local shapes, and status."""

    def __init__(self, result: dict[str, Any], exit_code: int) -> None:
        super().__init__(result)
        self.result = result
        self.exit_code = exit_code


class _Server:
    """One session for every question a command asks, opened at the first (so a bad flag or
    spec is reported before any wait for the server)."""

    def __init__(self, args: argparse.Namespace, stack: ExitStack) -> None:
        self.args = args
        self.stack = stack
        self.opened: Session | None = None

    def session(self) -> Session:
        if self.opened is None:
            self.opened = self.stack.enter_context(connection_from_args(self.args).session())
        return self.opened


def _tls_problem(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.server and (args.tls_cert is None) != (args.tls_key is None):
        problem = "give --tls-cert and --tls-key together (the client certificate for mTLS)"
        return {"invalid": [{"field": "--tls-cert", "description": problem}]}
    return None


def run(args: argparse.Namespace) -> int:
    if args.policy == "measured" and not args.server:
        problem = "--policy measured needs --server (a worker times the backends)"
        result = {"invalid": [{"field": "--policy", "description": problem}]}
        print(json.dumps(result) if args.json else render_table(result), file=sys.stderr)
        return EXIT_BAD_INPUT
    if (invalid := _tls_problem(args)) is not None:
        print(json.dumps(invalid) if args.json else render_table(invalid))
        return EXIT_BAD_INPUT
    if args.timeout is None:
        args.timeout = MEASURED_TIMEOUT_S if args.policy == "measured" else DEFAULT_TIMEOUT_S
    if not args.server:
        return _run(args, None)
    from service.client.errors import ServerNotReadyError

    try:
        with ExitStack() as stack:
            return _run(args, _Server(args, stack))
    except ServerNotReadyError as exc:
        print(f"moe-control select: {exc}", file=sys.stderr)
        return EXIT_NOT_READY
    except _MatrixFailedError as exc:
        print(json.dumps(exc.result) if args.json else render_table(exc.result), file=sys.stderr)
        return exc.exit_code
    except _OutOfTimeError:
        message = deadline_message(args)
        if args.json:
            error = {"stage": "server", "type": "DEADLINE_EXCEEDED", "message": message}
            print(json.dumps({"error": error, "candidates": []}))
        else:
            print(message, file=sys.stderr)
        return EXIT_SERVER_ERROR


def _run(args: argparse.Namespace, server: _Server | None) -> int:
    try:
        gpus = fleet.gpu_names(args.gpu)
        rulesets = fleet.ruleset_names(args.ruleset)
        args.gpu = gpus[0] if gpus else None
        if args.config is not None:
            configs = load_model_configs(args.config)
            if len(configs) > 1 or len(gpus) > 1 or len(rulesets) > 1 or args.csv:
                models = matrix.models_from_configs(configs)
                return _run_matrix(args, server, models, gpus, rulesets)
            specs: Iterator[Any] = iter([deployment_from_model_config(configs[0].config)])
        elif len(gpus) > 1 or len(rulesets) > 1 or args.csv:
            problem = "a matrix (several GPUs or rulesets, --csv) needs --config"
            raise InvalidSpecError.single("--gpu", problem)
        else:
            specs = read_deployments(args.deployment)
        status = EXIT_OK
        first = True
        for raw in specs:
            if isinstance(raw, InvalidSpecError):
                result, code = answer(raw)
            elif not isinstance(raw, dict):
                result, code = answer(InvalidSpecError.single("", "a spec must be a JSON object"))
            else:
                spec = apply_flags(raw, args)
                # Without --ruleset, a spec's own "ruleset" (else the newest release) decides.
                chosen = rulesets[0] if args.ruleset else None
                if server is not None:
                    result, code = _remote(args, server, spec, chosen or "")
                else:
                    result, code = answer(spec, chosen)
            status = max(status, code)
            if args.json:
                print(json.dumps(result, sort_keys=False))
            else:
                if not first:
                    print()
                print(render_table(result))
            first = False
        return status
    except OracleError as exc:
        result, code = answer(exc) if isinstance(exc, InvalidSpecError) else ({}, EXIT_BAD_INPUT)
        print(json.dumps(result) if args.json else render_table(result), file=sys.stderr)
        return code


def _run_matrix(
    args: argparse.Namespace,
    server: _Server | None,
    models: list[fleet.MatrixModel],
    gpus: list[str],
    rulesets: list[str],
) -> int:
    """Models by GPUs (by rulesets): every cell decided as a single `select` decides it
    (with --server, every cell in the one session, under the one --timeout)."""
    if not gpus:
        raise InvalidSpecError.single("--gpu", "required for a matrix: presets or 'all'")
    if args.policy == "measured":
        raise InvalidSpecError.single("--policy", "a matrix is static (one worker measures)")

    if server is not None:
        table = _remote_matrix(args, server, models, gpus, rulesets)
        if table is None:  # a server without SelectMatrix: one SelectBackend per cell
            table = _matrix_by_cells(args, server, models, gpus, rulesets)
    else:
        table = _matrix_by_cells(args, None, models, gpus, rulesets)
    print(matrix.render(table, "json" if args.json else "csv" if args.csv else "table"))
    return table.exit_code


def _matrix_by_cells(
    args: argparse.Namespace,
    server: _Server | None,
    models: list[fleet.MatrixModel],
    gpus: list[str],
    rulesets: list[str],
) -> fleet.Matrix:
    """Every cell decided here, or asked of the server one SelectBackend at a time."""

    def spec_for(spec: Any, gpu: str) -> dict[str, Any]:
        return apply_flags(spec, argparse.Namespace(**{**vars(args), "gpu": gpu}))

    def decide(spec: Any, ruleset: str) -> tuple[dict[str, Any], int]:
        if server is not None:
            return _remote(args, server, spec, ruleset)
        return answer(spec, ruleset, what_would_change=False)  # a cell shows no hints

    return fleet.build_matrix(models, gpus, rulesets, spec_for=spec_for, answer=decide)


def _remote_matrix(
    args: argparse.Namespace,
    server: _Server,
    models: list[fleet.MatrixModel],
    gpus: list[str],
    rulesets: list[str],
) -> fleet.Matrix | None:
    """The matrix in one SelectMatrix call: the rows' specs with the flags applied (the
    platform's --packages and --env sent once, laid over each GPU by the server); rows
    without a spec are invalid here, as locally. None: the server has no SelectMatrix."""
    import grpc

    from service.client.errors import RemoteSelectionError
    from service.client.select import remote_matrix

    no_gpu = argparse.Namespace(**{**vars(args), "gpu": None, "packages": None, "env": []})
    rows = {m.label: apply_flags(dict(m.spec), no_gpu) for m in models if m.spec is not None}
    overlay = platform_flags(args)
    cells: dict[tuple[str, str, str], fleet.Cell] = {}
    if rows:
        try:
            decided = remote_matrix(
                server.session(),
                [(m.label, m.origin, rows[m.label]) for m in models if m.label in rows],
                gpus,
                rulesets,
                platform=overlay,
            )
        except RemoteSelectionError as exc:
            if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _OutOfTimeError from None
            if exc.code is grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise _MatrixFailedError(exc.result, exc.exit_code) from None
        cells = {(c.model, c.ruleset, c.gpu): c for c in decided}
    invalid = fleet.build_matrix(
        [m for m in models if m.spec is None],
        gpus,
        rulesets,
        spec_for=lambda spec, gpu: dict(spec),
        answer=lambda spec, ruleset: ({}, EXIT_OK),  # never asked: these rows have no spec
    )
    cells.update({(c.model, c.ruleset, c.gpu): c for c in invalid.cells})
    ordered = tuple(
        cells[(m.label, ruleset, gpu)] for m in models for ruleset in rulesets for gpu in gpus
    )
    return fleet.Matrix(tuple(models), tuple(gpus), tuple(rulesets), ordered)


def _remote(
    args: argparse.Namespace,
    server: _Server,
    spec: dict[str, Any],
    ruleset: str = "",
) -> tuple[dict[str, Any], int]:
    """One answer from the server; `ruleset` "" leaves it to the spec (else the newest)."""
    import grpc

    from service.client.errors import RemoteSelectionError
    from service.client.select import remote_select

    measured = args.policy == "measured"
    try:
        session = server.session()
        if measured:
            print(measuring_notice(args.tokens, args.timeout, args.refresh), file=sys.stderr)
        result = remote_select(
            session,
            spec,
            ruleset=ruleset,
            measured=measured,
            token_counts=args.tokens,
            refresh=args.refresh,
            measure_worker_index=args.measure_worker,
            # the measured answer says what runs fastest; the change search is static's
            what_would_change=not measured,
        )
    except RemoteSelectionError as exc:
        if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise _OutOfTimeError from None
        return with_id(spec, exc.result), exc.exit_code
    result = with_id(spec, result)
    if any(h.get("code") == "VLLM_FAILS" for h in result.get("hazards") or []):
        # MEASURED answers where vLLM would fail; the exit status still says vLLM fails.
        return result, EXIT_SELECTION_FAILED
    return result, EXIT_OK
