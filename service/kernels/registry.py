"""The one table of the backends a worker can run: every other list derives from this one.

A row names a backend as the oracle spells it, the class that runs it (``module:Class``,
imported on first use by `interface.load_backend_class`, so this module stays free of torch
and can be read by the server process), the layouts (`service.formats` writers, by name) its
class prepares, and whether a forward may be captured in a CUDA graph. The worker picks
classes from it, the measured policy times exactly these backends, and the worker's profile
reports each one's availability (each row's class answers `unavailable_reason`: the probe
needs torch, which this table must not import). The classes take their `layouts` and
`graph_capturable` from here (`ExpertsBackend.__init_subclass__`);
`tests/kernels/test_registry.py` checks that every layout named here has a writer and that
each class agrees with its row.

Adding a backend is one row here (and its writer in `service.formats.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BACKENDS",
    "RUNNABLE",
    "Backend",
    "backend",
    "class_row",
    "layouts_run_by",
    "runner_for",
]


@dataclass(frozen=True)
class Backend:
    """One runnable backend: its name, the class that runs it and what it reads."""

    name: str
    """The backend's name as vLLM's oracle spells it (``"TRITON"``)."""
    experts: str
    """The `ExpertsBackend` subclass that runs it, as ``"module:Class"`` (imported lazily)."""
    reads: tuple[str, ...]
    """The layouts (by writer name) this backend's class prepares, its own first."""
    graph_capturable: bool
    """Whether a forward may be captured in a CUDA graph (no host synchronisation inside).
    Timers read this instead of trying: a capture that fails midway leaves torch's CUDA
    random generator in capture mode, so every later `torch.randn` on the device raises."""
    dense_experts: str | None = None
    """The class that runs this backend's own layout when it differs from `experts`
    (EMULATION's own layout is dense bf16; the other layouts it reads are quantized)."""

    @property
    def layout(self) -> str:
        """The layout this backend's converter writes."""
        return self.reads[0]


BACKENDS: tuple[Backend, ...] = (
    Backend(
        "HUMMING",
        "service.kernels.humming:HummingExperts",
        reads=("HUMMING",),
        graph_capturable=True,
    ),
    # The BATCHED_MARLIN writer writes the same tensors (both backends run one op).
    Backend(
        "MARLIN",
        "service.kernels.marlin:MarlinExperts",
        reads=("MARLIN", "BATCHED_MARLIN"),
        graph_capturable=True,
    ),
    # Not capturable: it sizes its per-expert batch on the host (a device-to-host read).
    Backend(
        "BATCHED_MARLIN",
        "service.kernels.batched_marlin:BatchedMarlinExperts",
        reads=("BATCHED_MARLIN", "MARLIN"),
        graph_capturable=False,
    ),
    Backend(
        "TRITON",
        "service.kernels.triton.experts:TritonWNA16Experts",
        reads=("TRITON",),
        graph_capturable=True,
    ),
    # Not capturable: it loops over the routed experts on the host.
    Backend(
        "EMULATION",
        "service.kernels.emulation:EmulationExperts",
        reads=("EMULATION", "TRITON", "MARLIN", "BATCHED_MARLIN"),
        graph_capturable=False,
        dense_experts="service.kernels.dense:DenseEmulationExperts",
    ),
)
"""Every backend a worker has kernels for, in the measured policy's timing order."""

RUNNABLE: tuple[str, ...] = tuple(row.name for row in BACKENDS)
"""The names of `BACKENDS`, in order."""

_BY_NAME = {row.name: row for row in BACKENDS}


def backend(name: str) -> Backend | None:
    """The row of backend `name`, or None when no worker can run it."""
    return _BY_NAME.get(name)


def runner_for(name: str, layout: str) -> str | None:
    """The ``module:Class`` that runs backend `name` on a layer in `layout`, or None when
    that backend cannot read that layout (a backend is never substituted)."""
    row = _BY_NAME.get(name)
    if row is None or layout not in row.reads:
        return None
    if layout == row.layout and row.dense_experts is not None:
        return row.dense_experts
    return row.experts


def layouts_run_by(path: str) -> frozenset[str]:
    """The layouts whose layers the class ``module:Class`` runs (under any backend's row)."""
    return frozenset(
        layout for row in BACKENDS for layout in row.reads if runner_for(row.name, layout) == path
    )


def class_row(path: str) -> Backend | None:
    """The row whose `experts` or `dense_experts` is the class ``module:Class``, if any."""
    return next((row for row in BACKENDS if path in (row.experts, row.dense_experts)), None)
