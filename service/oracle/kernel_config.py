"""`--moe-backend` as `vllm serve` parses it, before any quantization code runs.

vLLM's argument parser converts the flag's value with `s.lower().replace("-", "_")` and then
checks it against the `choices` that `get_kwargs(KernelConfig)` derives from the
`MoEBackend` literal (sorted). So `TRITON` and `flashinfer-trtllm` become `triton` and
`flashinfer_trtllm`, while a name outside the literal stops `vllm serve` with argparse's
`ArgumentError` (stage `kernel_config`), whose text is reproduced here exactly as Python
3.11's argparse (the interpreter vLLM's environment runs) words it. The accepted names are
the ruleset's data (`Ruleset.kernel_config_moe_backends`), since they differ per release.
"""

from __future__ import annotations

from service.oracle.errors import ErrorInfo, SelectionError


def normalise_moe_backend(name: str) -> str:
    """The value vLLM's `--moe-backend` converter hands on: lower case, `-` as `_`."""
    return name.lower().replace("-", "_")


def refusal(value: str, accepted: tuple[str, ...]) -> ErrorInfo:
    """argparse's refusal of a converted value outside the parser's (sorted) choices."""
    choices = ", ".join(repr(name) for name in sorted(accepted))
    return ErrorInfo(
        "kernel_config",
        "ArgumentError",
        f"argument --moe-backend: invalid choice: {value!r} (choose from {choices})",
    )


def parse_moe_backend(name: str, accepted: tuple[str, ...]) -> str:
    """The `moe_backend` a KernelConfig ends up with; raises `SelectionError` (stage
    `kernel_config`) where `vllm serve` refuses the flag."""
    value = normalise_moe_backend(name)
    if value not in accepted:
        raise SelectionError(refusal(value, accepted))
    return value
