"""`moe-control run` and `moe-control demo`: a fused MoE forward, and the walkthrough.

`run` makes a small random GPTQ layer (quantized with our quantizer), converts it to
--backend and runs one forward on random hidden states and router logits, then prints the
backend, the device time and the error against the fp32 dequantized reference. Locally it
all happens in this process, with the worker's own code (conversion, routing, the prepared
backend); with --server it calls RunMoE, by --layer-id (the held layer's shape from
ListLayers) or with the layer inline, and the server compares with its own fp32 reference
on the layer it ran. Either way the exit status is 1 when the error is over --tolerance.

`demo` is the first thing a newcomer runs: it starts nothing external. It quantizes a small
random layer, asks the oracle what vLLM would pick (on an H100 and on this machine),
converts to EMULATION and TRITON, runs both (TRITON under Triton's interpreter when there
is no GPU), compares with the fp32 reference and prints each step and a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from service.cli.client_flags import BadFlagError, add_connection_arguments, connection_from_args
from service.cli.shape import check_shape
from service.client.exits import EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_NOT_READY, EXIT_SERVER_ERROR

#: The demo's layer: small enough for Triton's CPU interpreter in a few seconds.
DEMO_SHAPE = {"experts": 8, "top_k": 2, "hidden": 128, "intermediate": 128, "tokens": 16}
#: Relative error (Frobenius, against the fp32 reference) a backend must stay under.
TOLERANCE = 1e-2


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run_parser = subparsers.add_parser(
        "run",
        help="one fused MoE forward (locally, or RunMoE on a server)",
        description="Run a fused MoE forward on random inputs and compare it with the fp32 "
        "dequantized reference. Locally on a random GPTQ layer; with --server through RunMoE "
        "(--layer-id: a layer the server holds; otherwise a random layer sent inline).",
    )
    _shape_arguments(run_parser, DEMO_SHAPE, held_layer_wins=True)
    run_parser.add_argument(
        "--backend",
        help="EMULATION (default), TRITON, MARLIN or HUMMING; --layer-id: default the layer's own",
    )
    run_parser.add_argument("--device", default="cpu", help="local: cpu or cuda:N")
    add_connection_arguments(
        run_parser, default_timeout=600.0, server_help="call RunMoE on HOST:PORT"
    )
    run_parser.add_argument(
        "--layer-id",
        default="",
        help="--server: a kept layer's id (its shape comes from the server's ListLayers)",
    )
    run_parser.add_argument("--validate", action="store_true", help="check inputs for NaN/Inf")
    run_parser.add_argument("--warmup", type=int, default=0, help="untimed iterations")
    run_parser.add_argument("--iterations", type=int, default=1, help="timed iterations")
    run_parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"largest relative error that passes (default {TOLERANCE:g}); exit 1 above it",
    )
    run_parser.set_defaults(handler=run)

    demo = subparsers.add_parser(
        "demo",
        help="the walkthrough: quantize, ask the oracle, convert, run, compare (no server)",
        description="Quantize a small random MoE layer, ask the oracle which backend vLLM "
        "would pick, convert to EMULATION and TRITON, run both and compare with the fp32 "
        "reference. Starts nothing external; on a CPU-only machine TRITON runs under "
        "Triton's interpreter (TRITON_INTERPRET=1).",
    )
    _shape_arguments(demo, DEMO_SHAPE)
    demo.set_defaults(handler=run_demo)


def _shape_arguments(
    parser: argparse.ArgumentParser, shape: dict[str, int], *, held_layer_wins: bool = False
) -> None:
    """--experts, --top-k, --hidden, --intermediate, --tokens (and the quantization). With
    `held_layer_wins` they default to None, so a held layer's shape can fill what was not
    given (`_fill_shape`)."""
    for name, value in shape.items():
        flag = "--" + name.replace("_", "-")
        default = None if held_layer_wins else value
        parser.add_argument(flag, dest=name, type=int, default=default, help=f"default {value}")
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--group-size", type=int, default=32, help="-1: channelwise")
    parser.add_argument("--seed", type=int, default=0)


def _fill_shape(args: argparse.Namespace, held: dict[str, int] | None = None) -> None:
    """Give every shape flag left unset its value: the held layer's, else the demo's. A flag
    given that contradicts the held layer is an error (the server would refuse it)."""
    if held is not None and args.top_k is not None:
        raise BadFlagError("--top-k: a held layer routes with its own top-k (its deployment's)")
    for name, value in DEMO_SHAPE.items():
        given = getattr(args, name)
        if held is not None and name in held:
            if given is not None and given != held[name]:
                flag = "--" + name.replace("_", "-")
                raise BadFlagError(f"{flag} {given}: the held layer has {held[name]}")
            setattr(args, name, held[name])
        elif given is None:
            setattr(args, name, value)


def _interpret_triton_on_cpu() -> None:
    """Triton reads TRITON_INTERPRET when a kernel is decorated: set it before our kernel
    modules are imported, on a machine without a GPU only."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class Example:
    """A random quantized layer, its GPTQ checkpoint tensors and random inputs."""

    layer: Any
    checkpoint: dict[str, Any]
    quant_config: dict[str, Any]
    hidden: Any
    logits: Any
    reference: Any


def make_example(args: argparse.Namespace) -> Example:
    import torch

    from service.formats.readers import GPTQ, SourceQuantization, write_checkpoint
    from service.formats.synthetic.quantize import random_layer
    from service.kernels.activation import resolve
    from service.kernels.emulation import reference_forward
    from service.kernels.routing import topk_route

    gen = torch.Generator().manual_seed(args.seed)
    layer = random_layer(
        args.experts,
        args.hidden,
        args.intermediate,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=True,
        generator=gen,
    )
    checkpoint = write_checkpoint(
        GPTQ, layer, SourceQuantization(args.bits, args.group_size), naming="mixtral"
    )
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, generator=gen)
    weights, ids = topk_route(logits, args.top_k)
    reference = reference_forward(layer, hidden, ids, weights, resolve("silu"))
    quant = {
        "quant_method": "gptq",
        "bits": args.bits,
        "group_size": args.group_size,
        "desc_act": False,
        "sym": True,
    }
    return Example(layer, checkpoint, quant, hidden, logits, reference)


def deployment_json(args: argparse.Namespace, quant: dict[str, Any], platform: str) -> Any:
    return {
        "hf_quantization_config": quant,
        "layer": {
            "num_experts": args.experts,
            "top_k": args.top_k,
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate,
        },
        "platform": platform,
    }


@dataclass
class Row:
    backend: str
    layout_bytes: int
    convert_s: float
    forward_s: float
    max_abs: float
    relative: float
    note: str = ""
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        return self.relative < self.tolerance


def run_local(example: Example, args: argparse.Namespace, backend: str, device: str) -> Row:
    """Convert and run in this process with the worker's own code (no server)."""
    import torch

    from service.formats.routes import inline
    from service.formats.routes.spec import SourceSpec
    from service.kernels.routing import topk_route
    from service.worker.layers import LoadedLayer
    from service.worker.run import prepared

    began = time.perf_counter()
    result = inline.convert_layer(
        example.checkpoint,
        source=SourceSpec("gptq", args.bits, args.group_size),
        backend=backend,
        shape=inline.LayerShape(args.experts, args.hidden, args.intermediate),
        device=device,
        keep_device=True,
    )
    convert_s = time.perf_counter() - began
    descriptor = result.descriptor
    info = {
        "format": {
            "backend": backend,
            "bits": int(descriptor.get("bits", args.bits)),
            "group_size": int(descriptor.get("group_size", args.group_size)),
            "has_zero_points": bool(descriptor.get("has_zero_points", False)),
        },
        "num_experts": args.experts,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
    }
    size = sum(t.numel() * t.element_size() for t in result.tensors.values())
    loaded = LoadedLayer("local", info, dict(result.tensors))
    target = torch.device(device)
    runner = prepared(loaded, backend, target)
    hidden = example.hidden.to(target)
    weights, ids = topk_route(example.logits.to(target), args.top_k)
    began = time.perf_counter()
    out = runner.forward(hidden, ids, weights, "silu")
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    forward_s = time.perf_counter() - began
    return _row(
        backend,
        size,
        convert_s=convert_s,
        forward_s=forward_s,
        out=out,
        reference=example.reference,
    )


def _row(
    backend: str,
    size: int,
    *,
    convert_s: float,
    forward_s: float,
    out: Any,
    reference: Any,
) -> Row:
    import torch

    diff = out.to("cpu", torch.float32) - reference
    return Row(
        backend,
        size,
        convert_s,
        forward_s,
        float(diff.abs().max()),
        float(diff.norm() / reference.norm()),
    )


def render(rows: list[Row]) -> str:
    header = (
        f"{'backend':<10} {'layout bytes':>12} {'convert':>9} {'forward':>9} "
        f"{'max |err|':>10} {'rel err':>9}  result"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        verdict = "ok" if row.ok else f"FAIL (> {row.tolerance:g})"
        if row.note:
            verdict = row.note
        lines.append(
            f"{row.backend:<10} {row.layout_bytes:>12,} {_ms(row.convert_s):>9} "
            f"{_ms(row.forward_s):>9} {row.max_abs:>10.2e} {row.relative:>9.2e}  {verdict}"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def run(args: argparse.Namespace) -> int:
    _interpret_triton_on_cpu()
    try:
        if args.server:
            return _run_remote(args)
        _fill_shape(args)
        backend = (args.backend or "EMULATION").strip().upper()
        check_shape(args, runs=(backend,))
        example = make_example(args)
        row = run_local(example, args, backend, args.device)
        row.tolerance = args.tolerance
    except BadFlagError:
        raise  # exit 2, the flag named (`cli.main`)
    except Exception as exc:  # a CLI reports, it does not trace back
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(render([row]))
    return 0 if row.ok else 1


def _run_remote(args: argparse.Namespace) -> int:
    """RunMoE with compare_with_reference: the server runs its fp32 reference on the very
    layer it ran (the held one, or the inline one it converted), so the error printed is the
    backend's, not a difference between two random layers."""
    import grpc

    from service.client.errors import ServerNotReadyError
    from service.client.run import held_layer_shape, run_remote

    try:
        # One session: --timeout covers the wait, the listing and the run together.
        with connection_from_args(args).session() as session:
            if args.layer_id:
                _fill_shape(args, held_layer_shape(session, args.layer_id))
            else:
                _fill_shape(args)
            check_shape(args, makes_layer=not args.layer_id)
            response = run_remote(session, _remote_request(args))
    except ServerNotReadyError as exc:
        print(f"moe-control run: {exc}", file=sys.stderr)
        return EXIT_NOT_READY
    except grpc.RpcError as error:
        call: Any = error
        code = call.code()
        print(f"{code.name}: {call.details() or 'no message'}", file=sys.stderr)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return EXIT_BAD_INPUT
        return EXIT_NOT_FOUND if code is grpc.StatusCode.NOT_FOUND else EXIT_SERVER_ERROR
    return _report_remote(args, response)


def _remote_request(args: argparse.Namespace) -> Any:
    import torch

    from service.client.run import deployment_pb, run_request

    inline = None
    backend = (args.backend or "").strip().upper()
    if args.layer_id:
        gen = torch.Generator().manual_seed(args.seed)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16)
        logits = torch.randn(args.tokens, args.experts, generator=gen)
    else:
        example = make_example(args)
        hidden, logits = example.hidden, example.logits
        spec = deployment_pb(
            example.quant_config,
            num_experts=args.experts,
            top_k=args.top_k,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
        )
        inline = (spec, example.checkpoint)
        backend = backend or "EMULATION"
    return run_request(
        hidden,
        layer_id=args.layer_id,
        inline=inline,
        router_logits=logits,
        backend=backend,
        validate=args.validate,
        compare=True,
        warmup=args.warmup,
        iterations=args.iterations,
    )


def _report_remote(args: argparse.Namespace, response: Any) -> int:
    """The backend, the time and the error against the server's reference; exit 1 when the
    relative error (max |out - ref| / max |out|) is over --tolerance."""
    from service.client.run import tensor_from_pb

    out = tensor_from_pb(response.output).float()
    seconds = response.device_time.ToNanoseconds() / 1e9
    layer = f"layer {args.layer_id}" if args.layer_id else "an inline layer"
    kind = f" ({response.experts_class})" if response.experts_class else ""
    print(
        f"{response.backend}{kind} on worker {response.worker_index}, {layer}: "
        f"{args.tokens} tokens, device time {_ms(seconds)}"
    )
    if not response.HasField("max_abs_error"):
        print("the server sent no comparison with its reference: nothing to check")
        return 1
    scale = float(out.abs().max()) if out.numel() else 0.0
    relative = response.max_abs_error / scale if scale > 0 else float(response.max_abs_error)
    verdict = "ok" if relative < args.tolerance else f"FAIL (> {args.tolerance:g})"
    print(
        f"max |err| vs the server's fp32 reference {response.max_abs_error:.2e}, relative to "
        f"max |out| {relative:.2e}: {verdict}"
    )
    return 0 if relative < args.tolerance else 1


#: The backends the demo runs: they run everywhere.
DEMO_BACKENDS = ("EMULATION", "TRITON")


def run_demo(args: argparse.Namespace) -> int:
    _interpret_triton_on_cpu()  # before the shape check imports the Triton kernels
    check_shape(args, runs=DEMO_BACKENDS)
    import torch

    from service.oracle import SelectionError, select
    from service.worker.probe import probe

    began = time.perf_counter()
    print(
        f"1. Quantize a random MoE layer with our quantizer: {args.experts} experts, "
        f"hidden {args.hidden}, intermediate {args.intermediate}, int{args.bits} GPTQ, "
        f"group {args.group_size}, top-{args.top_k}; {args.tokens} tokens of bf16 input."
    )
    example = make_example(args)
    print(
        f"   checkpoint tensors: {len(example.checkpoint)} (per expert: w1, w3, w2 x qweight, "
        "qzeros, scales, g_idx)"
    )
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    local = probe(device).get("platform")
    platforms: list[tuple[str, Any]] = [("h100", "h100"), ("this machine", local or "cpu")]
    print("2. Ask the oracle which WNA16 MoE backend vLLM 0.33 would pick:")
    for label, platform in platforms:
        spec = deployment_json(args, example.quant_config, platform)
        try:
            decision = select(spec)
            print(f"   {label:<13} -> {decision.backend} ({decision.experts_class})")
        except SelectionError as exc:
            print(f"   {label:<13} -> none: {exc.error.type}: {exc.error.message}")
    print(
        "   (the demo runs EMULATION and TRITON whatever the pick: they run everywhere; "
        "MARLIN and HUMMING need an NVIDIA GPU)"
    )
    print(
        "3. Convert to EMULATION (dense bf16) and TRITON (vLLM's Triton WNA16 layout) and run "
        f"each forward on {device}"
        + (" (Triton under TRITON_INTERPRET=1)" if device == "cpu" else "")
        + ":"
    )
    rows = [run_local(example, args, backend, device) for backend in DEMO_BACKENDS]
    print(
        "4. Compare with the fp32 dequantized reference (relative Frobenius error, "
        f"tolerance {TOLERANCE:g} for bf16 activations):\n"
    )
    print(render(rows))
    print(f"\ndone in {time.perf_counter() - began:.1f} s")
    return 0 if all(row.ok for row in rows) else 1
