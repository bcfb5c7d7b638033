"""The errors a worker process raises about its own state: the layers it holds.

They cross the pipe as a type name, a message and details (`jobs.describe` looks up their
category by class name), so the server rebuilds them without importing this module.
"""

from __future__ import annotations

from service.errors import MoeControlError


class LayerBudgetError(MoeControlError):
    """A layer that cannot fit the worker's layer budget even with every other one evicted."""

    def __init__(self, needed: int, budget: int) -> None:
        self.field = "layer_budget"
        self.needed = needed
        self.budget = budget
        self.description = (
            f"the layer needs {needed} bytes, more than the worker's whole layer budget of "
            f"{budget} bytes (setting layer_budget_mib)"
        )
        super().__init__(self.description)


class LayerMissingError(MoeControlError, LookupError):
    """No layer with this id on this worker (evicted, unloaded, or never made)."""

    def __init__(self, layer_id: str) -> None:
        self.field = "layer_id"
        self.description = f"this worker holds no layer {layer_id!r} (unloaded or evicted)"
        super().__init__(self.description)
