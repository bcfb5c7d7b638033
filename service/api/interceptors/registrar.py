"""Registration through the interceptor chain: handlers are wrapped on their way in, and
only the hot method is handed to grpc's core as a pre-registered method.

grpc.aio keeps a pending request per pre-registered method, and its accept loop passes all
of them to `asyncio.wait` for every call it accepts, so each one costs every call of every
method (the figures are in bench/RESULTS.md). Every other method is found through a generic
handler: one dict lookup per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import grpc

from service.api.interceptors.handlers import Handler
from service.api.names import method_path

#: The methods handed to grpc's core as pre-registered methods: only the one called at
#: high rates is worth a pending request of its own.
PRE_REGISTERED = frozenset({method_path("SelectBackend")})

Wrap = Callable[[str, Handler], Handler]


class _WrappedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose answers come wrapped (only found methods are remembered, so
    made-up method names cannot grow the cache)."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Wrap) -> None:
        self._inner = inner
        self._wrap = wrap

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        return self._wrap(handler_call_details.method, handler)


class _ByMethod(grpc.GenericRpcHandler):
    def __init__(self, handlers: dict[str, Handler]) -> None:
        self._handlers = handlers

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        return self._handlers.get(handler_call_details.method)


class HandlerRegistrar:
    """Stands in for a `grpc.aio.Server` in the generated `add_*Servicer_to_server`
    functions (and anything else that registers handlers), wrapping each handler on its way
    in. Registered (pre-resolved) methods are collected per service and handed over to the
    server once, by `install()` (each method is registered by exactly one caller)."""

    def __init__(self, server: grpc.aio.Server, wrap: Wrap) -> None:
        self._server = server
        self._wrap = wrap
        self._registered: dict[str, dict[str, Handler]] = {}
        self._generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Handler]) -> None:
        known = self._registered.setdefault(service, {})
        twice = sorted(set(known) & set(handlers))
        if twice:
            raise ValueError(f"{service}: {twice} registered twice (each method has one handler)")
        known.update(handlers)

    def install(self, registered: Callable[[str], bool] = PRE_REGISTERED.__contains__) -> None:
        """Hand the collected methods to the server: those `registered(full_method)` accepts
        (by default the PRE_REGISTERED ones) as pre-registered methods, the rest through a
        generic handler that is asked before the generic handlers registered here (the
        generated code registers each method both ways; the registered form is the one that
        counts)."""
        generic: dict[str, Handler] = {}
        for service, handlers in self._registered.items():
            chosen: dict[str, Handler] = {}
            for name, handler in handlers.items():
                method = f"/{service}/{name}"
                wrapped = self._wrap(method, handler)
                if registered(method):
                    chosen[name] = wrapped
                else:
                    generic[method] = wrapped
            if chosen:
                self._server.add_registered_method_handlers(service, chosen)
        wrapped_generic = [_WrappedGenericHandler(h, self._wrap) for h in self._generic]
        self._server.add_generic_rpc_handlers((_ByMethod(generic), *wrapped_generic))
        self._registered.clear()
        self._generic.clear()
