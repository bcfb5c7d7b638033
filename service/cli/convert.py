"""`moe-control convert`: checkpoint expert weights into a kernel layout, locally or remotely.

Two modes, chosen by INPUT:

* a model directory: the whole checkpoint (every MoE layer converted, the rest copied, a
  manifest written; a re-run verifies finished layers and resumes);
* a .safetensors file: one MoE layer's expert tensors (per-expert names, full checkpoint
  names, or vLLM's stacked w13_/w2_ parameters) into one .safetensors file.

Locally the conversion runs in this process on --device; with --server a moe-control server
runs it (path mode: INPUT and OUTPUT are on the server's data root; layer mode streams the
tensors there and back). The target is --backend, or vLLM's own choice for --platform (or
this machine / the server's worker).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from service.cli.client_flags import add_connection_arguments, connection_from_args
from service.client.exits import EXIT_BAD_INPUT, EXIT_OK, EXIT_SERVER_ERROR, EXIT_UNSUPPORTED

EXIT_SERVER = EXIT_SERVER_ERROR
GB = 1e9


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert checkpoint expert weights into a kernel layout (whole models or one layer)",
        description="Convert a quantized MoE checkpoint's expert weights into a vLLM kernel "
        "layout. INPUT is a model directory (whole checkpoint -> OUTPUT directory with "
        "converted shards, index and moe-control-manifest.json; re-runs resume) or a "
        ".safetensors file with one MoE layer (-> OUTPUT .safetensors).",
    )
    parser.add_argument(
        "input", nargs="?", help="model directory, or .safetensors file of one MoE layer"
    )
    parser.add_argument(
        "output", nargs="?", help="output directory (model) or .safetensors file (layer)"
    )
    parser.add_argument("--input", dest="input_flag", metavar="INPUT", help="same as INPUT")
    parser.add_argument("--output", dest="output_flag", metavar="OUTPUT", help="same as OUTPUT")
    parser.add_argument(
        "--backend",
        default="auto",
        help="target WNA16 backend (MARLIN, TRITON, EMULATION, ...); 'auto' (default): "
        "vLLM's choice for the platform",
    )
    parser.add_argument(
        "--platform", "--gpu", dest="platform", help="platform preset whose choice 'auto' takes"
    )
    parser.add_argument("--ruleset", default="", help="vLLM release rules (default vllm-0.33)")
    parser.add_argument(
        "--layers", help="model mode: decoder layers START:END to convert (half open)"
    )
    parser.add_argument(
        "--layer", type=int, help="layer mode: the decoder layer to take from a file of several"
    )
    parser.add_argument("--config", type=Path, help="layer mode: the model's config.json")
    parser.add_argument("--deployment", type=Path, help="layer mode: a deployment spec JSON")
    parser.add_argument("--device", default="cpu", help="local mode: cpu or cuda:N")
    add_connection_arguments(
        parser, default_timeout=None, server_help="convert on a moe-control server at HOST:PORT"
    )
    parser.add_argument("--worker", type=int, help="--server: the worker index to convert on")
    parser.add_argument(
        "--keep-loaded", action="store_true", help="--server layer mode: keep it for RunMoE"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show"
    )
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    parser.set_defaults(handler=run)


# ---------------------------------------------------------------------------------------
# Progress


class ProgressBar:
    """One redrawn line on a terminal; on a pipe, one line per finished layer or stage."""

    def __init__(self, stream: TextIO, enabled: bool | None) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.enabled = self.tty if enabled is None else enabled
        self.started = time.monotonic()
        self._last_stage = ""
        self._drawn = False

    def __call__(self, event: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        stage = str(event.get("stage", ""))
        done, total = int(event.get("layers_done", 0)), int(event.get("layers_total", 0))
        bytes_done, bytes_total = int(event.get("bytes_done", 0)), int(event.get("bytes_total", 0))
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = bytes_done / elapsed / GB
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            fraction = bytes_done / bytes_total if bytes_total else 0.0
            cells = 24
            filled = int(fraction * cells)
            bar = "#" * filled + "." * (cells - filled)
            text = (
                f"[{bar}] {done}/{total} layers  {bytes_done / GB:.2f}/{bytes_total / GB:.2f} GB"
                f"  {rate:.2f} GB/s  {stage} {event.get('current', '')}"
            )
            self.stream.write("\r" + text[: width - 1].ljust(width - 1))
            self._drawn = True
        elif stage in ("converted", "skipped", "copying", "finalizing") and (
            stage != self._last_stage or stage in ("converted", "skipped")
        ):
            self.stream.write(
                f"{stage} {event.get('current', '')} ({done}/{total} layers, "
                f"{bytes_done / GB:.2f}/{bytes_total / GB:.2f} GB)\n"
            )
        self._last_stage = stage
        self.stream.flush()

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# ---------------------------------------------------------------------------------------
# Entry


def _layers(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        return int(start or 0), int(end) if sep and end else 1 << 30
    except ValueError:
        raise _BadArgumentError("--layers", f"expected START:END, got {text!r}") from None


class _BadArgumentError(Exception):
    """A command-line value is wrong (exit 2)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def run(args: argparse.Namespace) -> int:
    bar = ProgressBar(sys.stderr, args.progress)
    try:
        for name in ("input", "output"):
            given = [v for v in (getattr(args, name), getattr(args, f"{name}_flag")) if v]
            if len(given) != 1:
                raise _BadArgumentError(name, f"give {name.upper()} once (or --{name})")
            setattr(args, name, given[0])
        if args.server:
            return _remote(args, bar)
        return _local(args, bar)
    except _BadArgumentError as exc:
        return _fail(EXIT_BAD_INPUT, str(exc))
    finally:
        bar.close()


def _fail(code: int, message: str) -> int:
    print(f"moe-control convert: {message}", file=sys.stderr)
    return code


def _is_model_dir(path: str) -> bool:
    return not path.endswith(".safetensors")


# ---------------------------------------------------------------------------------------
# Local


def _local(args: argparse.Namespace, bar: ProgressBar) -> int:
    from service.formats.errors import ConvertInputError, PermissionDeniedError
    from service.oracle import InvalidSpecError, SelectionError

    try:
        from service.formats.errors import ConversionUnsupported, FormatError

        try:
            if _is_model_dir(args.input):
                return _local_checkpoint(args, bar)
            return _local_layer(args)
        except ConversionUnsupported as exc:
            return _fail(
                EXIT_UNSUPPORTED,
                f"cannot write {exc.backend}: {exc.reason} (choose another --backend or "
                "--platform)",
            )
        except FormatError as exc:
            return _fail(EXIT_BAD_INPUT, str(exc))
    except (ConvertInputError, PermissionDeniedError) as exc:
        return _fail(EXIT_BAD_INPUT, str(exc))
    except InvalidSpecError as exc:
        return _fail(EXIT_BAD_INPUT, f"invalid deployment: {exc}")
    except SelectionError as exc:
        return _fail(
            EXIT_UNSUPPORTED,
            f"vLLM would select no backend ({exc.error.stage}): {exc.error.type}: "
            f"{exc.error.message} (name a --backend or another --platform)",
        )


def _platform(args: argparse.Namespace) -> Any:
    from service.oracle import PlatformProfile, preset
    from service.worker import probe

    if args.platform:
        return preset(args.platform, field_name="--platform")
    return PlatformProfile.from_json(probe.probe(args.device)["platform"])


def _local_checkpoint(args: argparse.Namespace, bar: ProgressBar) -> int:
    from service.formats.checkpoint.job import convert_checkpoint
    from service.formats.checkpoint.plan import plan_job
    from service.formats.io.paths import DataRoot

    job = plan_job(
        os.path.abspath(args.input),
        os.path.abspath(args.output),
        root=DataRoot.unconfined(),
        platform=_platform(args),
        backend="" if args.backend.lower() == "auto" else args.backend,
        ruleset=args.ruleset,
        layers=_layers(args.layers),
        device=args.device,
    )
    result = convert_checkpoint(job, progress=bar)
    bar.close()
    summary = {
        "backend": job.target.backend,
        "experts_class": job.target.experts_class,
        "backend_chosen_by": job.target.chosen_by,
        "manifest_path": str(result.manifest_path or ""),
        "layers_converted": result.layers_converted,
        "layers_skipped": result.layers_skipped,
        "bytes_in": result.bytes_in,
        "bytes_out": result.bytes_out,
        "elapsed_s": round(result.seconds, 3),
        "device_time_s": round(result.convert_seconds, 3),
        "tensors": len(result.tensors),
    }
    _print_checkpoint(summary, args.json)
    return EXIT_OK


def _print_checkpoint(summary: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    elapsed = summary["elapsed_s"]
    rate = summary["bytes_in"] / max(elapsed, 1e-9) / GB
    print(
        f"{_target_text(summary)}: {summary['layers_converted']} layers converted, "
        f"{summary['layers_skipped']} verified and kept, in {elapsed:.2f} s"
    )
    print(
        f"  read {summary['bytes_in'] / GB:.3f} GB, wrote {summary['bytes_out'] / GB:.3f} GB "
        f"({rate:.2f} GB/s); conversion time {summary['device_time_s']:.2f} s"
    )
    manifest = summary["manifest_path"]
    print(f"  manifest: {manifest}" if manifest else "  (other layer ranges still missing)")


def _target_text(summary: Mapping[str, Any]) -> str:
    """ "MARLIN (MarlinExperts, chosen by oracle)": the backend, with the experts class and
    who chose it when they are known (an unknown one is left out, never printed as None)."""
    known = [
        str(part)
        for part in (
            summary.get("experts_class"),
            summary.get("backend_chosen_by") and f"chosen by {summary['backend_chosen_by']}",
        )
        if part
    ]
    return f"{summary['backend']} ({', '.join(known)})" if known else str(summary["backend"])


def _deployment(args: argparse.Namespace, input_file: Path) -> dict[str, Any]:
    from service.oracle import deployment_from_model_config

    if args.deployment is not None:
        value = _read_json(args.deployment, "--deployment")
        if not isinstance(value, dict):
            raise _BadArgumentError("--deployment", "must hold a JSON object")
        return value
    config_path = args.config or input_file.parent / "config.json"
    config = _read_json(config_path, "--config")
    return deployment_from_model_config(config)


def _read_json(path: Path, field: str) -> Any:
    from service.oracle import InvalidSpecError
    from service.oracle.json_text import parse_json

    try:
        text = path.read_text()
    except OSError as exc:
        raise _BadArgumentError(field, f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise _BadArgumentError(field, f"{path} is not UTF-8: {exc.reason}") from None
    try:
        return parse_json(text, str(path), numbers_at="config" if field == "--config" else "")
    except InvalidSpecError as exc:
        raise _BadArgumentError(field, str(exc)) from None


def _layer_tensor_names(names: list[str], layer: int | None) -> list[str]:
    """The expert tensors of one layer in a file (all of them, or decoder layer `layer`)."""
    from service.formats.io.naming import match_expert_tensor, normalize_names

    hits = {name: match_expert_tensor(name) for name in names}
    if any(hits.values()):
        layers = {hit[1]: hit[2] for hit in hits.values() if hit is not None}
        modules = sorted(m for m, index in layers.items() if layer is None or index == layer)
        if len(modules) != 1:
            raise _BadArgumentError(
                "--layer", f"{len(modules)} MoE layers match in the file; pick one with --layer"
            )
        return [name for name, hit in hits.items() if hit is not None and hit[1] == modules[0]]
    normalize_names(names)
    return names


def _local_layer(args: argparse.Namespace) -> int:
    from service.formats.io.safetensors import (
        SafetensorsFile,
        SafetensorsWriter,
        plan_of,
        tensor_bytes,
    )
    from service.formats.routes.inline import LayerShape, convert_layer
    from service.formats.routes.spec import resolve_target, source_spec
    from service.oracle import parse_deployment

    input_file = Path(args.input)
    spec = _deployment(args, input_file)
    spec = {**spec, "platform": None}
    deployment = parse_deployment(spec, default_platform=_platform(args))
    source = source_spec(deployment.hf_quantization_config, quantization=deployment.quantization)
    target = resolve_target(
        deployment, "" if args.backend.lower() == "auto" else args.backend, ruleset=args.ruleset
    )
    began = time.perf_counter()
    try:
        file = SafetensorsFile(input_file)
    except OSError as exc:
        raise _BadArgumentError("input", f"cannot read {input_file}: {exc.strerror}") from None
    with file:
        names = _layer_tensor_names(list(file.entries), args.layer)
        tensors = {name: file.tensor(name) for name in names}
        bytes_in = sum(file.entries[n].nbytes for n in names)
        layer = deployment.layer
        result = convert_layer(
            tensors,
            source=source,
            backend=target.backend,
            shape=LayerShape(
                layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.is_gated
            ),
            device=args.device,
            vllm_quantization=deployment.quantization,
            ruleset=target.ruleset,
        )
        del tensors
    output = Path(args.output)
    metadata = {"format": "pt", "moe_control_backend": target.backend}
    with SafetensorsWriter(
        output, [plan_of(n, t) for n, t in result.tensors.items()], metadata
    ) as writer:
        for name, tensor in result.tensors.items():
            writer.write(name, tensor_bytes(tensor))
        writer.commit()
    summary = {
        "backend": target.backend,
        "experts_class": target.experts_class,
        "backend_chosen_by": target.chosen_by,
        "output": str(output),
        "descriptor": result.descriptor,
        "tensors": [
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "sha256": writer.sha256[name],
            }
            for name, tensor in result.tensors.items()
        ],
        "bytes_in": bytes_in,
        "bytes_out": writer.data_bytes,
        "elapsed_s": round(time.perf_counter() - began, 3),
        "device_time_s": round(result.device_seconds, 3),
    }
    _print_layer(summary, args.json)
    return EXIT_OK


def _print_layer(summary: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    print(
        f"{_target_text(summary)} -> {summary['output']} in {summary['elapsed_s']:.3f} s "
        f"(conversion {summary['device_time_s']:.3f} s)"
    )
    for tensor in summary["tensors"]:
        print(
            f"  {tensor['name']}  {tensor['dtype']} {tensor['shape']}  sha256 "
            f"{tensor['sha256'][:16]}"
        )


# ---------------------------------------------------------------------------------------
# Remote


_EXIT_OF_CODE = {
    "INVALID_ARGUMENT": EXIT_BAD_INPUT,
    "PERMISSION_DENIED": EXIT_BAD_INPUT,
    "NOT_FOUND": EXIT_BAD_INPUT,
    "UNIMPLEMENTED": EXIT_UNSUPPORTED,
    "FAILED_PRECONDITION": EXIT_UNSUPPORTED,
}


def _remote(args: argparse.Namespace, bar: ProgressBar) -> int:
    import grpc

    from service.api.codecs import conversion as convert_codec
    from service.client.convert import convert_checkpoint_remote, convert_layer_remote, header_for
    from service.client.errors import ServerNotReadyError

    connection = connection_from_args(args)
    backend = "" if args.backend.lower() == "auto" else args.backend
    try:
        if _is_model_dir(args.input):
            header = header_for(
                backend=backend,
                platform_preset=args.platform,
                ruleset=args.ruleset,
                checkpoint=(args.input, args.output),
                layers=_layers(args.layers),
                worker_index=args.worker,
            )
            summary = convert_checkpoint_remote(connection, header, bar)
            bar.close()
            data = convert_codec.summary_to_json(summary)
            _print_checkpoint(
                {
                    **data,
                    "backend": data["target_format"]["backend"],
                    "experts_class": data["target_format"]["experts_class"],
                    "tensors": len(data["tensors"]),
                },
                args.json,
            )
            return EXIT_OK
        return _remote_layer(args, connection, backend, header_for, convert_layer_remote)
    except ServerNotReadyError as exc:
        return _fail(EXIT_SERVER, str(exc))
    except grpc.RpcError as error:
        call: Any = error
        code = call.code().name
        details = call.details() or "no message from the server"
        return _fail(_EXIT_OF_CODE.get(code, EXIT_SERVER), f"{code}: {details}")


def _remote_layer(
    args: argparse.Namespace,
    connection: Any,
    backend: str,
    header_for: Any,
    convert_layer_remote: Any,
) -> int:
    from service.formats.io.safetensors import SafetensorsFile, SafetensorsWriter, TensorPlan
    from service.formats.io.streaming import DTYPES, FROM_SAFETENSORS, TensorSpec

    input_file = Path(args.input)
    deployment = _deployment(args, input_file)
    header = header_for(
        deployment_json=json.dumps(deployment),
        backend=backend,
        platform_preset=args.platform,
        ruleset=args.ruleset,
        keep_loaded=args.keep_loaded,
        worker_index=args.worker,
    )
    began = time.perf_counter()
    with SafetensorsFile(input_file) as file:
        names = _layer_tensor_names(list(file.entries), args.layer)
        tensors = {}
        for name in names:
            entry = file.entries[name]
            dtype = FROM_SAFETENSORS.get(entry.dtype)
            if dtype is None:
                raise _BadArgumentError(name, f"dtype {entry.dtype} cannot be sent")
            tensors[name] = (TensorSpec.of(name, dtype, entry.shape), file.raw(name))
        result = convert_layer_remote(connection, header, tensors)
        del tensors
    output = Path(args.output)
    plans = [
        TensorPlan(name, DTYPES[spec.dtype].safetensors, spec.shape, spec.byte_size)
        for name, (spec, _) in result.tensors.items()
    ]
    with SafetensorsWriter(output, plans, {"format": "pt"}) as writer:
        for name, (_, data) in result.tensors.items():
            writer.write(name, data)
        writer.commit()
    assert result.summary is not None
    summary = result.summary
    print_data = {
        "backend": summary.target_format.backend,
        "experts_class": summary.target_format.experts_class,
        "backend_chosen_by": summary.backend_chosen_by,
        "output": str(output),
        "layer_id": summary.layer_id,
        "tensors": [
            {"name": name, "dtype": spec.dtype, "shape": list(spec.shape), "sha256": spec.sha256}
            for name, (spec, _) in result.tensors.items()
        ],
        "bytes_in": summary.bytes_in,
        "bytes_out": summary.bytes_out,
        "elapsed_s": round(time.perf_counter() - began, 3),
        "device_time_s": round(summary.device_time.ToTimedelta().total_seconds(), 3),
    }
    _print_layer(print_data, args.json)
    if summary.layer_id and not args.json:
        print(f"  kept loaded as {summary.layer_id}")
    return EXIT_OK
