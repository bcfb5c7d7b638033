"""Wrapping vLLM functions wherever they are looked up, without importing vLLM.

vLLM's WNA16 integrations import `select_wna16_moe_backend` by name (`from
...oracle.int_wna16 import select_wna16_moe_backend`), so replacing the module attribute
alone would miss every module that imported it already. `install` therefore, per `Target`:

* when its module is already imported, replaces the function in it and in every loaded
  module of vLLM's model executor (where the integrations are) that holds it by name;
* otherwise puts one finder in front of `sys.meta_path` that lets the module load as usual
  and replaces the function right after the module has run, before any other module's
  `from ... import` can read it; the finder leaves once every target is patched.

Nothing of vLLM is imported by the plugin itself: vLLM's start-up pays a name check per
import and nothing else. A wrapper calls the real function with the same arguments and
returns its result or re-raises its exception unchanged (`observing`); what it sees goes to
a callback whose own failures are swallowed (vLLM's path never sees them).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

#: Set on a wrapper (to the function it wraps), so that nothing is wrapped twice.
MARK = "__moe_control_wraps__"


class ObservedCall(NamedTuple):
    """One call of a wrapped function: the real function, its arguments, the caller's frame,
    and its result or the exception it raised."""

    real: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    caller: types.FrameType | None
    result: Any
    error: BaseException | None


#: What is told each call, after it.
Observer = Callable[[ObservedCall], None]


class Target(NamedTuple):
    """A function of a vLLM module, and what to tell about each of its calls."""

    module: str
    function: str
    see: Observer


def observing(
    real: Callable[..., Any], see: Observer, on_error: Callable[[Exception], None]
) -> Callable[..., Any]:
    """`real`, observed: same arguments, same result, the same exception re-raised."""

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        try:
            result = real(*args, **kwargs)
        except BaseException as error:
            _tell(see, on_error, ObservedCall(real, args, kwargs, caller, None, error))
            raise
        _tell(see, on_error, ObservedCall(real, args, kwargs, caller, result, None))
        return result

    setattr(wrapper, MARK, real)
    return wrapper


def _tell(see: Observer, on_error: Callable[[Exception], None], call: ObservedCall) -> None:
    try:
        see(call)
    except Exception as exc:  # the plugin's failure is never vLLM's
        on_error(exc)


def patch_modules(
    loaded: Iterable[tuple[types.ModuleType, Target]],
    on_error: Callable[[Exception], None],
    *,
    rebind: bool = True,
) -> None:
    """Replace each target function in its module and, with `rebind`, in every loaded module
    under `REBOUND_PREFIX` holding it by name, in one pass over those modules (the cost of a
    late install). A module patched as it loads needs no pass: nothing can have imported the
    function from it before it finished running."""
    wrappers: dict[int, tuple[Any, Any]] = {}
    for module, target in loaded:
        real = getattr(module, target.function, None)
        if real is None or getattr(real, MARK, None) is not None:
            continue
        wrapper = observing(real, target.see, on_error)
        wrappers[id(real)] = (real, wrapper)
        setattr(module, target.function, wrapper)
    if not wrappers or not rebind:
        return
    hits = [
        (namespace, name, wrappers[id(value)])
        for namespace in _vllm_namespaces()
        for name, value in namespace.items()
        if id(value) in wrappers
    ]
    for namespace, name, (real, wrapper) in hits:
        if namespace.get(name) is real:
            namespace[name] = wrapper


#: Where vLLM's integrations live: the modules that may hold a target by name (vLLM's
#: quantization integrations, its MoE layers and model loaders). Only these are rebound on
#: a late install, which keeps its one pass to a few hundred namespaces.
REBOUND_PREFIX = "vllm.model_executor."


def _vllm_namespaces() -> list[dict[str, Any]]:
    return [
        vars(module)
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith(REBOUND_PREFIX)
    ]


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any, patch: Callable[[types.ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create: Any = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, get_resource_reader...: the real loader's (tracebacks,
        # inspect and importlib.resources ask the module's loader for them).
        return getattr(self._loader, name)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a target's module it asks the finders behind it and wraps
    the loader they return; it leaves `sys.meta_path` once no target is left."""

    def __init__(self, targets: Iterable[Target], on_error: Callable[[Exception], None]) -> None:
        self._pending = {target.module: target for target in targets}
        self._on_error = on_error

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        wanted = self._pending.pop(fullname, None)
        if wanted is None:
            return None
        if not self._pending:
            self.remove()
        for finder in sys.meta_path:
            if finder is self:
                continue
            find: Any = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = (
                None if find is None else find(fullname, path, target)
            )
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(
                        spec.loader,
                        lambda module: patch_modules(
                            [(module, wanted)], self._on_error, rebind=False
                        ),
                    )
                return spec
        return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install(targets: Iterable[Target], on_error: Callable[[Exception], None]) -> None:
    """Wrap each target now if its module is loaded, else as soon as it loads."""
    later, loaded = [], []
    for target in targets:
        module = sys.modules.get(target.module)
        if module is None:
            later.append(target)
        else:
            loaded.append((module, target))
    if loaded:
        patch_modules(loaded, on_error)
    if later:
        sys.meta_path.insert(0, PatchOnImport(later, on_error))
