"""The sizes `run` and `demo` are given, checked before anything is allocated.

Each rule is the one the code that would fail uses: the oracle's spec rules for the layer
(positive sizes a kernel can index, top-k within the experts), the GPTQ checkpoint layout's
for the quantization (a group dividing each K, packed axes whole words), the kernels' own
for a backend run here, and the machine's memory for the copies of the random layer and
the inputs. A size that breaks one is a `BadFlagError` naming the flag (exit 2), not a
traceback from deep inside the quantizer or an attempt to allocate terabytes.
"""

from __future__ import annotations

import argparse
import os

from service.cli.client_flags import BadFlagError

#: The spec field each shape flag fills.
SPEC_FLAGS = {
    "layer.num_experts": ("--experts", "experts"),
    "layer.top_k": ("--top-k", "top_k"),
    "layer.hidden_size": ("--hidden", "hidden"),
    "layer.intermediate_size": ("--intermediate", "intermediate"),
}
#: fp32, the dtype of the random layer's master weights, its reference and its inputs.
FP32_BYTES = 4
#: What one weight of the random layer costs at the peak, all copies alive at once: the fp32
#: master, the quantizer's fp32 working copy, the fp32 dequantized reference (4 bytes each),
#: the EMULATION layout's bf16 (2) and the packed codes with their scales (about 1).
BYTES_PER_WEIGHT = 3 * FP32_BYTES + 2 + 1
_GIB = 1 << 30


def check_shape(
    args: argparse.Namespace, *, makes_layer: bool = True, runs: tuple[str, ...] = ()
) -> None:
    """Raise `BadFlagError` unless the shape flags describe a layer this command can make
    (`makes_layer`; False: the layer is the server's, only the inputs are made here) and
    the backends it `runs` here take."""
    from service.oracle import InvalidSpecError, parse_deployment

    layer = {field: getattr(args, name) for field, (_, name) in SPEC_FLAGS.items()}
    spec = {
        "hf_quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1},
        "layer": {field.removeprefix("layer."): value for field, value in layer.items()},
        "platform": "cpu",
    }
    try:
        parse_deployment(spec)
    except InvalidSpecError as exc:
        violation = exc.violations[0]
        flag, name = SPEC_FLAGS[violation.field]
        raise BadFlagError(f"{flag} {getattr(args, name)}: {violation.description}") from None
    if args.tokens < 1:
        raise BadFlagError(f"--tokens {args.tokens}: must be an integer >= 1")
    if makes_layer:
        _check_layout(args)
    if "TRITON" in runs:
        _check_triton(args)
    _check_memory(args, makes_layer=makes_layer)


def _check_triton(args: argparse.Namespace) -> None:
    from service.kernels.errors import KernelUnavailableError
    from service.kernels.triton.experts import check_triton_shape

    try:
        check_triton_shape(args.hidden, args.intermediate)
    except KernelUnavailableError as exc:
        raise BadFlagError(
            f"--hidden {args.hidden}, --intermediate {args.intermediate}: {exc}"
        ) from None


def _check_layout(args: argparse.Namespace) -> None:
    """GPTQ's rules for both projections: w13 (N = 2 x intermediate, K = hidden) and w2
    (N = hidden, K = intermediate)."""
    from service.formats.errors import FormatError
    from service.formats.readers import GPTQ, SourceQuantization

    try:
        quant = SourceQuantization(args.bits, args.group_size)
    except FormatError as exc:
        raise BadFlagError(f"--group-size {args.group_size}: {exc.description}") from None
    for n, k, n_flag, k_flag in (
        (2 * args.intermediate, args.hidden, "--intermediate", "--hidden"),
        (args.hidden, args.intermediate, "--hidden", "--intermediate"),
    ):
        try:
            GPTQ.check_shape(quant, n, k)
        except FormatError as exc:
            if exc.field == "group_size":
                raise BadFlagError(
                    f"--group-size {args.group_size}: does not divide {k_flag} "
                    f"{getattr(args, k_flag[2:])} (-1: one group per channel)"
                ) from None
            flag = {"N": n_flag, "K": k_flag, "G": "--group-size", "bits": "--bits"}[exc.field]
            value = getattr(args, flag[2:].replace("-", "_"))
            raise BadFlagError(f"{flag} {value}: {exc.description} (GPTQ)") from None


def _check_memory(args: argparse.Namespace, *, makes_layer: bool) -> None:
    """The layer's copies (three projections per expert) and the inputs against this
    machine's physical memory."""
    needed = args.tokens * (args.hidden + args.experts) * FP32_BYTES
    if makes_layer:
        needed += 3 * args.experts * args.hidden * args.intermediate * BYTES_PER_WEIGHT
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > physical:
        flags = "--experts, --hidden, --intermediate, --tokens" if makes_layer else "--tokens"
        raise BadFlagError(
            f"{flags}: the layer and its inputs need {needed / _GIB:,.1f} GiB; "
            f"this machine has {physical / _GIB:,.1f} GiB"
        )
