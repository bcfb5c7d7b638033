"""The public server's registrations: the methods every process serves itself come from
its SelectionServicer only, whatever the worker side registers besides."""

from __future__ import annotations

from typing import Any

from service.api.servicer import SERVICE_NAME
from service.server.front import _WorkerSide


class Registrar:
    def __init__(self) -> None:
        self.registered: dict[str, dict[str, Any]] = {}
        self.generic: list[Any] = []

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered.setdefault(service, {}).update(handlers)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)


def test_the_worker_side_cannot_register_the_local_methods() -> None:
    registrar = Registrar()
    side = _WorkerSide(registrar)  # type: ignore[arg-type]
    whole = {"SelectBackend": 1, "ListPlatformPresets": 2, "RunMoE": 3}
    side.add_registered_method_handlers(SERVICE_NAME, whole)
    side.add_registered_method_handlers("other.Service", {"SelectBackend": 4})
    side.add_generic_rpc_handlers(("forwarder",))
    assert registrar.registered == {
        SERVICE_NAME: {"RunMoE": 3},
        "other.Service": {"SelectBackend": 4},
    }
    assert registrar.generic == ["forwarder"]
