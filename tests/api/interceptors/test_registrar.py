"""The registrar hands each method to the server once: a second registration is refused."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from service.api.interceptors.registrar import HandlerRegistrar


def handler() -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(lambda request, context: request)


def test_a_method_registered_twice_is_refused() -> None:
    registrar = HandlerRegistrar(object(), lambda method, h: h)  # type: ignore[arg-type]
    registrar.add_registered_method_handlers("pkg.Service", {"A": handler()})
    registrar.add_registered_method_handlers("other.Service", {"A": handler()})  # another service
    with pytest.raises(ValueError, match=r"pkg\.Service: \['A'\] registered twice"):
        registrar.add_registered_method_handlers("pkg.Service", {"A": handler(), "B": handler()})


def test_the_front_registers_every_method_of_the_service_once() -> None:
    """What the primary's front registers: its selection methods, then the worker ones."""
    from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb
    from service.api.names import SERVICE_NAME
    from service.api.servicer import MoeControlServicer
    from service.metrics import Metrics

    class Pool:
        generation = 0
        layer_budget_bytes = 0

        def default_profile(self) -> Any:
            return None

    servicer = MoeControlServicer(Pool(), Metrics())  # type: ignore[arg-type]
    registrar = HandlerRegistrar(object(), lambda method, h: h)  # type: ignore[arg-type]
    registrar.add_registered_method_handlers(SERVICE_NAME, servicer.selection.handlers())
    registrar.add_registered_method_handlers(SERVICE_NAME, servicer.worker_handlers())
    contract = {m.name for m in pb.DESCRIPTOR.services_by_name["MoeControlService"].methods}
    assert set(registrar._registered[SERVICE_NAME]) == contract
