"""`moe-control diff --from vllm-0.30 --to vllm-0.33`: what changes for each deployment when
a fleet moves from one vLLM release to another, and the rule or priority that moves it.

The deployments are read as `select` reads them (`select.add_deployment_arguments`): a spec
file (JSON, or JSON Lines with one spec per line), or model configs (`--config`: a
config.json, a model directory, a directory of configs, a Hugging Face repo id) on each
GPU of `--gpu`. Each one is answered under every ruleset from `--from` to `--to`
(service.oracle.upgrade), so that each change names the release that brings it.

It is a CI gate that does not cry wolf: a deployment "changes" when a field of `--fail-on`
does (service.oracle.gate; by default the backend, the experts class, and whether vLLM fails
it, at which stage and with which exception). Those get one row each, both answers and the
cause; the deployments that differ only elsewhere (by default a backend's verdict, as when a
release lists a backend more, or an error's wording) are listed apart and never fail the
gate. `--json` prints every deployment, changed or not, as `POST /v1/diff` answers it.

The exit status is a CI gate's: 0 when no field of `--fail-on` changes, 1 when one does, 2
for bad input (an unknown ruleset or `--fail-on` field, an invalid spec), 3 when the server
failed (`--server`). Locally it imports neither grpc nor torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.cli import matrix
from service.cli.client_flags import add_connection_arguments, connection_from_args
from service.cli.configs import load_model_configs
from service.cli.select import add_deployment_arguments, apply_flags, read_deployments
from service.client.exits import EXIT_BAD_INPUT, EXIT_CHANGED, EXIT_OK, EXIT_SERVER_ERROR
from service.dataplane import matrix as fleet
from service.oracle import (
    DEFAULT_RULESET,
    RULESETS,
    FieldViolation,
    InvalidSpecError,
    OracleError,
)
from service.oracle.gate import DEFAULT_FAIL_ON, GATE_FIELDS, parse_fail_on
from service.oracle.rulesets import resolve_ruleset
from service.oracle.upgrade import upgrade, upgrade_chain

if TYPE_CHECKING:
    from service.client.channel import Session

EXIT_UNCHANGED = EXIT_OK

#: The whole command's default deadline with --server (a diff takes milliseconds).
DEFAULT_TIMEOUT_S = 30.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    known = ", ".join(RULESETS)
    parser = subparsers.add_parser(
        "diff",
        help="what changes for each deployment from one vLLM release to another, and why",
        description="Answer each deployment under every ruleset from --from to --to and "
        "print one row per deployment whose answer changes in a field of --fail-on (by "
        "default the backend, the experts class, or the failure and its stage): both answers "
        "and the rule or priority that moved it; deployments that differ only elsewhere (a "
        "backend's verdict, an error's wording) are listed apart. Give --deployment (JSON, "
        "or JSON Lines with one spec per line) or --config (a config.json, a model "
        "directory, a directory of configs or a Hugging Face repo id) with --gpu (one "
        "preset, several, or 'all': each model on each GPU).",
        epilog="exit status: 0 when no field of --fail-on changes, 1 when one does (use it as "
        "a CI gate), 2 for bad input (an unknown ruleset or --fail-on field, an invalid "
        "spec), 3 when the server failed (--server).",
    )
    parser.add_argument(
        "--from",
        dest="start",
        required=True,
        metavar="RULESET",
        help=f"the release a fleet runs now (known: {known}; also written as '0.32', "
        "'0.32.0' or 'v0.32.0')",
    )
    parser.add_argument(
        "--to",
        dest="end",
        default=DEFAULT_RULESET,
        metavar="RULESET",
        help=f"the release it moves to (default {DEFAULT_RULESET}, the newest)",
    )
    parser.add_argument(
        "--fail-on",
        action="append",
        default=[],
        metavar="FIELDS",
        help="the fields whose change fails the gate, comma-separated or repeated: "
        + "; ".join(f"{name} ({meaning})" for name, meaning in GATE_FIELDS.items())
        + f" (default {','.join(DEFAULT_FAIL_ON)})",
    )
    add_deployment_arguments(
        parser, gpu_help="platform preset, e.g. h100; several (a100,h100) or 'all' with --config"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per deployment, changed or not (POST /v1/diff's answer)",
    )
    add_connection_arguments(
        parser,
        default_timeout=DEFAULT_TIMEOUT_S,
        server_help="ask a moe-control server at HOST:PORT (DiffRulesets) instead of "
        "answering locally",
    )
    parser.set_defaults(handler=run)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One deployment to compare: its label in the table, and its spec (or the error that
    says why there is none)."""

    label: str
    spec: dict[str, Any] | None
    invalid: InvalidSpecError | None = None


def _invalid_json(exc: InvalidSpecError) -> dict[str, Any]:
    return {"invalid": [{"field": v.field, "description": v.description} for v in exc.violations]}


def deployments(args: argparse.Namespace) -> Iterator[Deployment]:
    """Every deployment the flags name, in order: each spec of --deployment, or each model
    of --config on each GPU of --gpu (the matrix's rows and columns)."""
    gpus = fleet.gpu_names(args.gpu)
    if args.config is not None:
        if not gpus:
            raise InvalidSpecError.single("--gpu", "required with --config: presets or 'all'")
        models = matrix.models_from_configs(load_model_configs(args.config))
        for model in models:
            for gpu in gpus:
                label = f"{model.label} on {gpu}"
                if model.spec is None:
                    violations = (model.invalid or {}).get("invalid") or []
                    why = [FieldViolation(v["field"], v["description"]) for v in violations]
                    yield Deployment(label, None, InvalidSpecError(why))
                    continue
                flags = argparse.Namespace(**{**vars(args), "gpu": gpu})
                yield Deployment(label, apply_flags(dict(model.spec), flags))
        return
    if len(gpus) > 1:
        raise InvalidSpecError.single("--gpu", "several GPUs need --config (one spec file)")
    args.gpu = gpus[0] if gpus else None
    for number, raw in enumerate(read_deployments(args.deployment), start=1):
        label = f"{args.deployment.name}:{number}"
        if isinstance(raw, dict) and "id" in raw:
            label = str(raw["id"])
        if isinstance(raw, InvalidSpecError):
            yield Deployment(label, None, raw)
        elif not isinstance(raw, dict):
            yield Deployment(label, None, InvalidSpecError.single("", "a spec must be an object"))
        else:
            try:
                yield Deployment(label, apply_flags(raw, args))
            except InvalidSpecError as exc:
                yield Deployment(label, None, exc)


def answer(
    deployment: Deployment, start: str, end: str, fail_on: tuple[str, ...] = DEFAULT_FAIL_ON
) -> tuple[dict[str, Any], int]:
    """The deployment's upgrade from `start` to `end` as JSON, and the exit status it
    implies (1 when a field of `fail_on` changes)."""
    try:
        if deployment.invalid is not None:
            raise deployment.invalid
        assert deployment.spec is not None
        result = upgrade(deployment.spec, start, end).to_json(fail_on)
    except InvalidSpecError as exc:
        return _invalid_json(exc), EXIT_BAD_INPUT
    return result, EXIT_CHANGED if result["changed"] else EXIT_UNCHANGED


def summary(answer_json: dict[str, Any], other: dict[str, Any]) -> str:
    """An answer in a table cell: the backend (with its experts class where the other
    answer's differs), "FAILS (stage)" where vLLM fails, "unquantized" where vLLM builds
    no WNA16 method for the layer."""
    error = answer_json.get("error")
    if error:
        return f"FAILS ({error['stage']})"
    backend = answer_json.get("backend")
    if backend is None:
        return "unquantized"
    if answer_json.get("experts_class") != other.get("experts_class"):
        return f"{backend} ({answer_json.get('experts_class')})"
    return str(backend)


def _cause(difference: dict[str, str]) -> str:
    if difference["field"] == "backend":
        return difference["cause"]
    return f"{difference['field']}: {difference['cause']}"


def _others(row: dict[str, Any]) -> list[dict[str, str]]:
    others: list[dict[str, str]] = row.get("other_differences", [])
    return others


def render(
    rows: list[tuple[str, dict[str, Any]]],
    start: str,
    end: str,
    fail_on: tuple[str, ...] = DEFAULT_FAIL_ON,
) -> str:
    """The table of the deployments that change in a field of `fail_on`, then those that
    differ only elsewhere (apart: they do not fail the gate), then the invalid ones, then
    a count."""
    changed = [(label, r) for label, r in rows if r.get("changed")]
    other = [(label, r) for label, r in rows if not r.get("changed") and _others(r)]
    invalid = [(label, r) for label, r in rows if "invalid" in r]
    lines: list[str] = []
    if changed:
        table = [["DEPLOYMENT", start, end, "CAUSE"]]
        for label, r in changed:
            first = r["differences"][0]
            rest = len(r["differences"]) + len(_others(r)) - 1
            more = f" (+{rest} more; --json lists them)" if rest else ""
            before, after = summary(r["before"], r["after"]), summary(r["after"], r["before"])
            table.append([label, before, after, _cause(first) + more])
        widths = [max(len(row[i]) for row in table) for i in range(3)]
        for row in table:
            cells = [v.ljust(w) for v, w in zip(row[:3], widths, strict=True)]
            lines.append("  ".join([*cells, row[3]]).rstrip())
        lines.append("")
    if other:
        lines.append(
            f"{len(other)} more differ only outside --fail-on {','.join(fail_on)} "
            "(not gated; --json lists them), by difference and cause:"
        )
        groups: Counter[tuple[str, str]] = Counter(
            (d["field"], d["cause"]) for _, r in other for d in _others(r)
        )
        for (field, cause), count in groups.most_common():
            lines.append(f"  {count:>4} x {field}: {cause}")
        lines.append("")
    for label, r in invalid:
        why = "; ".join(f"{v['field']}: {v['description']}" for v in r["invalid"])
        lines.append(f"invalid {label}: {why}")
    failed = [(label, r["error"]) for label, r in rows if "changed" not in r and "error" in r]
    for label, error in failed:  # the server failed the call: no answer came back
        lines.append(f"error {label} (server): {error['type']}: {error['message']}")
    answered = len(rows) - len(invalid) - len(failed)
    counted = f"{answered} deployment" + ("" if answered == 1 else "s")
    gated = ", ".join(fail_on)
    if changed:
        lines.append(f"{len(changed)} of {counted} change from {start} to {end} ({gated})")
    elif answered:
        lines.append(f"no answer changes from {start} to {end} ({counted}; {gated})")
    else:
        lines.append("no deployment was answered")
    if other:
        lines[-1] += f"; {len(other)} more differ only in other fields (not gated)"
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        start = resolve_ruleset(args.start, field="--from")
        end = resolve_ruleset(args.end, field="--to")
        fail_on = parse_fail_on(args.fail_on, field="--fail-on")
        if args.server:
            return _run_remote(args, start, end, fail_on)
        return _report(args, start, end, fail_on, lambda d: answer(d, start, end, fail_on))
    except OracleError as exc:
        violations = exc.violations if isinstance(exc, InvalidSpecError) else ()
        if args.json:
            print(json.dumps(_invalid_json(InvalidSpecError(violations))), file=sys.stderr)
        else:
            for v in violations:
                print(f"moe-control diff: {v.field}: {v.description}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _report(
    args: argparse.Namespace, start: str, end: str, fail_on: tuple[str, ...], decide: Any
) -> int:
    """Answer every deployment with `decide`, print them, and return the worst status."""
    rows: list[tuple[str, dict[str, Any]]] = []
    status = EXIT_UNCHANGED
    for deployment in deployments(args):
        result, code = decide(deployment)
        status = max(status, code)
        rows.append((deployment.label, result))
        if args.json:
            print(json.dumps({"deployment": deployment.label, **result}))
    if not args.json:
        print(render(rows, start, end, fail_on))
    return status


def _run_remote(args: argparse.Namespace, start: str, end: str, fail_on: tuple[str, ...]) -> int:
    """Every deployment through one session (one --timeout for the whole command)."""
    from service.client.errors import RemoteSelectionError, ServerNotReadyError
    from service.client.upgrade import remote_upgrade

    chain = upgrade_chain(start, end)
    with ExitStack() as stack:
        opened: list[Session] = []

        def decide(deployment: Deployment) -> tuple[dict[str, Any], int]:
            if deployment.invalid is not None or deployment.spec is None:
                return answer(deployment, start, end, fail_on)
            if not opened:
                opened.append(stack.enter_context(connection_from_args(args).session()))
            try:
                result = remote_upgrade(opened[0], deployment.spec, chain, fail_on)
            except RemoteSelectionError as exc:
                return exc.result, exc.exit_code
            return result, EXIT_CHANGED if result["changed"] else EXIT_UNCHANGED

        try:
            return _report(args, start, end, fail_on, decide)
        except ServerNotReadyError as exc:
            print(f"moe-control diff: {exc}", file=sys.stderr)
            return EXIT_SERVER_ERROR
