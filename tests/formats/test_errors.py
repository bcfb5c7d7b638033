"""The formats layer's errors: one torch-free module, one root, the mixins callers catch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.errors import MoeControlError
from service.formats import errors

BAD_INPUT = [
    errors.ConvertInputError,
    errors.ConvertLimitError,
    errors.StreamError,
    errors.StreamLimitError,
    errors.InvalidPathError,
    errors.FormatError,
]


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_derives_from_the_root(name: str) -> None:
    assert issubclass(getattr(errors, name), MoeControlError)


@pytest.mark.parametrize("cls", BAD_INPUT, ids=lambda c: c.__name__)
def test_bad_input_stays_a_value_error(cls: type[Exception]) -> None:
    assert issubclass(cls, ValueError)


def test_limits_are_input_errors_with_the_limit_named() -> None:
    exc = errors.StreamLimitError(
        "tensors[w2_qweight].size", "too large", "convert_max_layer_bytes"
    )
    assert isinstance(exc, errors.StreamError) and isinstance(exc, errors.ConvertLimitError)
    assert (exc.field, exc.description, exc.limit) == (
        "tensors[w2_qweight].size",
        "too large",
        "convert_max_layer_bytes",
    )


def test_the_module_imports_no_torch() -> None:
    code = "import sys, service.formats.errors; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
