#!/usr/bin/env python
"""A vLLM release's own answer to "which WNA16 MoE backend does this deployment get?".

Usage (the release must be importable, e.g. the environment `make test` builds)::

    /tmp/vllmvenv/bin/python tests/parity/vllm_reference.py < specs.jsonl > answers.jsonl

Each non-blank stdin line is one normalised deployment spec (see the parity tests); each
stdout line is vLLM's answer for it, in the same order. Where vLLM raises, the answer
carries the stage, exception type and message; where the harness itself fails on a spec,
the answer is ``{"id": ..., "harness_error": "<traceback summary>"}`` and the run goes on.

This is the reference the pure-Python oracle in ``service/oracle`` is compared against, so
nothing in here re-implements a vLLM rule: every decision is taken by vLLM's own code, and
only the *machine* is faked.

How the machine is faked, and why
---------------------------------
vLLM decides from ``vllm.platforms.current_platform`` (device kind, compute capability),
from which optional packages are installed, from ``VLLM_*`` environment variables and from
the distributed world (TP/DP/EP ranks). None of these can be real on a CPU-only CI box, so:

1. Every vLLM module on the decision path is imported first, on the real (unspecified)
   platform. Modules that branch on the platform at import time therefore take the same
   branch for every spec; a module first imported later, under a fake, is rebound too.
2. The platform classes are vLLM's real ones (``CudaPlatformBase``, ``RocmPlatform``,
   ``XPUPlatform``, ``CpuPlatform``/``ZenCpuPlatform``), subclassed only to answer the
   questions a driver would answer (capability, device name, device count, CPU
   architecture: x86, or Arm where the spec says it is not x86). Importing them needs
   stand-ins for compiled extensions that cannot load here (``vllm._C_stable_libtorch``,
   ``vllm_xpu_kernels``) and, for ROCm, a GCN arch at import time. Per spec an instance is
   bound to ``vllm.platforms._current_platform`` and to every ``vllm.*`` module global that
   held the previous platform object. For ROCm the module's ``_GCN_ARCH`` is set and its
   ``_ON_*`` flags are recomputed by executing ``vllm/platforms/rocm.py``'s own assignment
   statements.
3. Installed-package probes (``has_humming``, every ``has_flashinfer*``, ``has_zentorch_op``,
   ``IS_AITER_FOUND``, and on a CPU ``vllm.triton_utils.HAS_TRITON``, triton-cpu), the x86
   AMX probe ``torch.cpu._is_amx_tile_supported`` and the checkpoint-metadata reader
   ``get_safetensors_params_metadata`` (there is no checkpoint on disk) are replaced
   wherever they were imported by name, by functions that read the spec.
   ROCm's ``torch.ops._rocm_C.moe_gptq_gemm_rdna3`` is assumed built (as in a ROCm build).
4. ``VLLM_*`` variables are set per spec (all others unset) and the ``functools`` caches of
   ``vllm.envs``, the platforms, the utils, the fused-MoE and the quantization modules are
   cleared between specs (FlashInfer availability, ROCm capability etc. are cached).
5. The distributed world is four stand-in group coordinators in
   ``vllm.distributed.parallel_state`` (TP, DP, PCP, EP) with the spec's sizes and rank 0.

The path then run per spec is vLLM's: ``Platform.validate_environ`` as
``EngineArgs.create_engine_config`` calls it (stage ``environment``: 0.34 refuses removed and
retired ``VLLM_*`` variables there), ``ModelConfig._verify_quantization`` (on a stand-in
``self``), ``VllmConfig._get_quantization_config`` (``get_quant_config``, capability and
dtype gates), a real ``VllmConfig`` (whose construction runs the platform's
``check_and_update_config``: stage ``platform``, after the parallel config's own validation,
stage ``moe_method``) made current with ``set_current_vllm_config``, and the
real ``FusedMoEFactory``, whose ``RoutedExperts`` asks the quant config for its MoE method
(``get_quant_method``: skip lists, GPTQModel ``dynamic`` rules, Marlin-shape fall-back to
MoeWNA16), whose ``__init__`` runs ``select_wna16_moe_backend``. The layer then runs its
EPLB check and is stopped just before it allocates expert weights (its hidden-size
round-up, which needs the all2all packages, is skipped: it changes nothing reported).
``select_wna16_moe_backend`` is wrapped where the methods look it up, to record its
arguments; the per-backend candidate list is recomputed (by the plugin's
``moe_control_vllm.verdicts``, the same code the plugin reports with) with vLLM's
``_get_priority_backends``, ``_backend_incompatibility_reason``, ``backend_to_kernel_cls``
and ``is_supported_config``, for the backends vLLM itself judges (up to the first that
fits, or only the forced one; judging the others could raise where vLLM does not), and
checked against what the real call returned (a mismatch is reported as a ``harness_error``).

The spec's ``moe_backend`` takes the path ``vllm serve --moe-backend`` takes: vLLM's own
argument parser (``EngineArgs.add_cli_args`` on a ``FlexibleArgumentParser``, built once, with
``exit_on_error`` off so that a refusal is an exception rather than an exit) converts it
(lower case, ``-`` to ``_``) and checks it against the choices derived from KernelConfig's
``MoEBackend`` literal. A refused name is recorded as stage ``kernel_config`` with argparse's
``ArgumentError`` and its exact message; an accepted one is assigned to the ``KernelConfig``
as ``EngineArgs.create_engine_config`` assigns it (only when it is not ``auto``).

Deliberate departures from a full ``vllm serve``: ``VllmConfig`` is built with
``optimization_level=0`` (the default level imports compiled fusion passes; compilation plays
no part in MoE selection), and a ``LoRAConfig`` is attached after construction (its
validation needs a real ``ModelConfig``).
The model dtype is the spec's layer dtype; the worker's device-dtype check is not run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The vLLM plugin's source in this checkout (its verdicts are this harness's candidates).
_PLUGIN = Path(__file__).resolve().parents[2] / "plugin"

# --------------------------------------------------------------------------------------
# Process plumbing: vLLM logs to stdout by default; answers must own it.
# --------------------------------------------------------------------------------------


def _claim_stdout() -> Any:
    """Return a writer on the real stdout and point fd 1 (and sys.stdout) at stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


# --------------------------------------------------------------------------------------
# Bootstrap: import vLLM on the real platform, then the platform modules.
# --------------------------------------------------------------------------------------

_QUANT = "vllm.model_executor.layers.quantization"
_MOE = "vllm.model_executor.layers.fused_moe"
_CT_MOE = f"{_QUANT}.compressed_tensors.compressed_tensors_moe"

_DECISION_PATH_MODULES = (
    "vllm.envs",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm._aiter_ops",
    "vllm.transformers_utils.config",
    "vllm.transformers_utils.model_arch_config_convertor",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.model_executor.kernels.linear.zentorch_utils",
    _QUANT,
    f"{_QUANT}.auto_gptq",
    f"{_QUANT}.auto_awq",
    f"{_QUANT}.moe_wna16",
    f"{_QUANT}.humming",
    f"{_QUANT}.compressed_tensors.compressed_tensors",
    f"{_CT_MOE}.compressed_tensors_moe",
    f"{_CT_MOE}.compressed_tensors_moe_wna16",
    f"{_QUANT}.utils.flashinfer_mxint4_moe",
    f"{_QUANT}.utils.marlin_utils",
    f"{_MOE}.layer",
    f"{_MOE}.routed_experts",
    f"{_MOE}.unquantized_fused_moe_method",
    f"{_MOE}.oracle.int_wna16",
    f"{_MOE}.experts.marlin_moe",
    f"{_MOE}.experts.triton_moe",
    f"{_MOE}.experts.trtllm_mxint4_moe",
    f"{_MOE}.experts.fused_humming_moe",
    f"{_MOE}.experts.xpu_moe",
    f"{_MOE}.experts.cpu_moe",
    f"{_MOE}.experts.int4_emulation_moe",
    "vllm.models.deepseek_v4",
)
# Imported when possible: reached only on some platforms / flags.
_OPTIONAL_MODULES = (f"{_CT_MOE}.compressed_tensors_moe_w4a16_flydsl",)
# Imported where the release has them (zentorch_moe from 0.31, rdna3_moe and deepseek_v41
# from 0.30); where it has one, importing it must work.
_RELEASE_MODULES = (
    f"{_MOE}.experts.zentorch_moe",
    f"{_MOE}.experts.rdna3_moe",
    "vllm.models.deepseek_v41",
)

_STAND_IN_MODULES = (
    "vllm._C_stable_libtorch",
    "vllm_xpu_kernels",
    "vllm_xpu_kernels._C",
    "vllm_xpu_kernels._moe_C",
    "vllm_xpu_kernels._xpu_C",
)


def _import_decision_path() -> None:
    """Import the modules above (and every registered quant config) on the real platform."""
    for name in _DECISION_PATH_MODULES:
        importlib.import_module(name)
    for name in _RELEASE_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    for name in _OPTIONAL_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    quantization = sys.modules[_QUANT]
    for method in quantization.QUANTIZATION_METHODS:
        quantization.get_quantization_config(method)


def _install_stand_ins() -> None:
    """Empty modules for compiled extensions that cannot load without their device."""
    for name in _STAND_IN_MODULES:
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)


def _import_rocm_platform() -> types.ModuleType:
    """Import vllm.platforms.rocm, which asks the driver for a GCN arch at import time."""
    import torch

    real = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *_a, **_k: types.SimpleNamespace(gcnArchName="gfx942")
    try:
        return importlib.import_module("vllm.platforms.rocm")
    finally:
        torch.cuda.get_device_properties = real


def _rocm_arch_flags_code(rocm: types.ModuleType) -> types.CodeType:
    """rocm.py's own module-level ``_ON_* = ...`` statements, compiled for re-execution."""
    tree = ast.parse(inspect.getsource(rocm))
    statements = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign)
        and all(isinstance(t, ast.Name) and t.id.startswith("_ON_") for t in node.targets)
    ]
    return compile(ast.Module(body=statements, type_ignores=[]), rocm.__file__, "exec")


# --------------------------------------------------------------------------------------
# The faked machine.
# --------------------------------------------------------------------------------------

_FAKE_DEVICE_COUNT = 1 << 12  # any TP x DP in a spec fits "this node"
_GIB = 1 << 30


@dataclass
class _Machine:
    """What the spec says about the machine; the package probes read it."""

    packages: frozenset[str] = frozenset()
    amx: bool = False


_MACHINE = _Machine()


class _FakeDevice:
    """Mixin answering the driver questions; all other platform logic is vLLM's."""

    fake_device_name = "fake"

    @classmethod
    def device_count(cls) -> int:
        return _FAKE_DEVICE_COUNT

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return cls.fake_device_name

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 141 * _GIB


def _parse_capability(text: str | None) -> tuple[int, int] | None:
    if text in (None, ""):
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


class _PlatformFactory:
    """Builds (and caches) one real-platform-subclass instance per machine kind."""

    def __init__(self) -> None:
        from vllm.platforms.interface import CpuArchEnum, DeviceCapability

        _install_stand_ins()
        cuda = importlib.import_module("vllm.platforms.cuda")
        self.rocm = _import_rocm_platform()
        xpu = importlib.import_module("vllm.platforms.xpu")
        cpu = importlib.import_module("vllm.platforms.cpu")
        zen_cpu = importlib.import_module("vllm.platforms.zen_cpu")
        self._arch_flags = _rocm_arch_flags_code(self.rocm)
        self._capability_cls = DeviceCapability
        self._bases = {
            "cuda": cuda.CudaPlatformBase,
            "rocm": self.rocm.RocmPlatform,
            "xpu": xpu.XPUPlatform,
            "cpu": cpu.CpuPlatform,
            "zen_cpu": zen_cpu.ZenCpuPlatform,
        }
        self._x86 = CpuArchEnum.X86
        self._arm = CpuArchEnum.ARM
        self._cache: dict[tuple, Any] = {}

    def platform_for(self, spec_platform: dict) -> Any:
        device = spec_platform["device"]
        if device == "rocm":
            self._set_gcn_arch(spec_platform.get("arch") or "")
        if device == "cpu" and "zentorch" in _MACHINE.packages:
            device = "zen_cpu"
        key = (
            device,
            spec_platform.get("capability"),
            spec_platform.get("arch"),
            spec_platform.get("x86", True),
        )
        if key not in self._cache:
            self._cache[key] = self._make(device, spec_platform)()
        return self._cache[key]

    def _set_gcn_arch(self, arch: str) -> None:
        namespace = vars(self.rocm)
        namespace["_GCN_ARCH"] = arch
        exec(self._arch_flags, namespace)

    def _make(self, device: str, spec_platform: dict) -> type:
        if device not in self._bases:
            raise ValueError(f"unknown platform device {device!r}")
        attrs: dict[str, Any] = {"fake_device_name": spec_platform.get("arch") or device}
        if device == "cuda":
            attrs.update(self._cuda_attrs(spec_platform.get("capability")))
        if device in ("cpu", "zen_cpu"):
            arch = self._x86 if spec_platform.get("x86", True) else self._arm
            attrs["get_cpu_architecture"] = classmethod(lambda cls: arch)
        name = f"Fake{self._bases[device].__name__}"
        return type(name, (_FakeDevice, self._bases[device]), attrs)

    def _cuda_attrs(self, capability_text: str | None) -> dict[str, Any]:
        parsed = _parse_capability(capability_text)
        capability = self._capability_cls(*parsed) if parsed else None
        return {
            "fake_device_name": f"NVIDIA sm_{capability_text}",
            "get_device_capability": classmethod(lambda cls, device_id=0: capability),
        }


class _GlobalRebinder:
    """Swaps one object for another in every loaded ``vllm.*`` module's globals."""

    def __init__(self, current: Any) -> None:
        self.current = current
        self._slots: list[tuple[dict, str]] = []
        self._scanned = 0
        self._rescan()

    def rebind(self, new: Any) -> None:
        if len(sys.modules) != self._scanned:
            self._rescan()
        for namespace, name in self._slots:
            if namespace.get(name) is self.current:
                namespace[name] = new
        self.current = new

    def _rescan(self) -> None:
        self._slots = _slots_holding(self.current)
        self._scanned = len(sys.modules)


def _vllm_namespaces() -> list[dict]:
    return [
        vars(module)
        for name, module in list(sys.modules.items())
        if module is not None and (name == "vllm" or name.startswith("vllm."))
    ]


def _slots_holding(obj: Any) -> list[tuple[dict, str]]:
    return [
        (namespace, name)
        for namespace in _vllm_namespaces()
        for name, value in list(namespace.items())
        if value is obj
    ]


def _replace_everywhere(original: Any, replacement: Any) -> None:
    for namespace, name in _slots_holding(original):
        namespace[name] = replacement


# Package probes, replaced once; they read _MACHINE, which changes per spec.


def _fake_has_humming() -> bool:
    return "humming" in _MACHINE.packages


def _fake_has_flashinfer(*_args: Any, **_kwargs: Any) -> bool:
    return "flashinfer" in _MACHINE.packages


def _fake_has_zentorch_op(op_names: list[str]) -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_zen_cpu() and "zentorch" in _MACHINE.packages


def _apply_triton_probe(device: str) -> None:
    """``HAS_TRITON`` as the CPU platform reads it (lazily, from ``vllm.triton_utils``): on a
    CPU whether the spec installs triton-cpu; elsewhere the real value, untouched. The engine
    config's own copy (``vllm.config.vllm``, imported by name: 0.27 to 0.32 refuse
    ``VLLM_USE_V2_MODEL_RUNNER=1`` without Triton while building it) is what the machine has:
    a GPU install of vLLM always brings Triton, which this CPU host cannot load for a GPU."""
    from vllm import triton_utils
    from vllm.config import vllm as engine_config

    if device == "cpu":
        triton_utils.HAS_TRITON = "triton" in _MACHINE.packages
        engine_config.HAS_TRITON = triton_utils.HAS_TRITON
    else:
        triton_utils.HAS_TRITON = _REAL_HAS_TRITON[0]
        engine_config.HAS_TRITON = True


_REAL_HAS_TRITON: list[bool] = []


def _fake_amx_tile_supported() -> bool:
    return _MACHINE.amx


def _no_checkpoint_metadata(*_args: Any, **_kwargs: Any) -> dict:
    return {}


_NOT_PACKAGE_PROBES = {"has_flashinfer_jit_cache_wheels", "has_nvidia_artifactory"}


def _install_package_probes() -> None:
    import torch
    import vllm.transformers_utils.config as hf_utils
    import vllm.utils.flashinfer as flashinfer_utils
    from vllm.model_executor.kernels.linear import zentorch_utils
    from vllm.utils import import_utils

    _replace_everywhere(import_utils.has_humming, _fake_has_humming)
    for name, value in list(vars(flashinfer_utils).items()):
        if name.startswith("has_") and name not in _NOT_PACKAGE_PROBES and callable(value):
            _replace_everywhere(value, _fake_has_flashinfer)
    _replace_everywhere(zentorch_utils.has_zentorch_op, _fake_has_zentorch_op)
    _replace_everywhere(hf_utils.get_safetensors_params_metadata, _no_checkpoint_metadata)
    torch.cpu._is_amx_tile_supported = _fake_amx_tile_supported
    from vllm import triton_utils

    _REAL_HAS_TRITON.append(bool(triton_utils.HAS_TRITON))
    # A ROCm build of vLLM registers this op in _rocm_C; the check is ROCm-only.
    torch.ops._rocm_C.moe_gptq_gemm_rdna3 = _no_checkpoint_metadata


_CACHED_PREFIXES = (
    "vllm.envs",
    "vllm.platforms",
    "vllm.utils",
    "vllm.config",
    "vllm._aiter_ops",
    "vllm.model_executor.kernels",
    _MOE,
    _QUANT,
)


def _collect_cache_clearers() -> list:
    clearers: dict[int, Any] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_CACHED_PREFIXES):
            continue
        for value in list(vars(module).values()):
            for cached in _cached_functions(value, name):
                clearers[id(cached)] = cached.cache_clear
    return list(clearers.values())


def _cached_functions(value: Any, module_name: str) -> list:
    if isinstance(value, functools._lru_cache_wrapper):
        return [value]
    if not (isinstance(value, type) and value.__module__ == module_name):
        return []
    inner = [getattr(member, "__func__", member) for member in vars(value).values()]
    return [fn for fn in inner if isinstance(fn, functools._lru_cache_wrapper)]


class _FakeGroup:
    """Stand-in GroupCoordinator: this process is rank 0 of a group of ``world_size``."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank_in_group = 0
        self.rank = 0
        self.local_rank = 0
        self.ranks = list(range(world_size))


class _World:
    """Installs one spec's machine: platform, packages, env, caches, distributed groups."""

    def __init__(self) -> None:
        from vllm import platforms

        self._platforms_module = platforms
        self._factory = _PlatformFactory()
        _install_package_probes()
        self._platform = _GlobalRebinder(platforms.current_platform)
        self._cache_clearers = _collect_cache_clearers()
        self._env_keys: set[str] = set()

    def enter(self, spec: dict) -> None:
        spec_platform = spec["platform"]
        _MACHINE.packages = frozenset(spec_platform.get("packages") or ())
        _MACHINE.amx = bool(spec_platform.get("amx"))
        self._apply_env(spec_platform.get("env") or {})
        platform = self._factory.platform_for(spec_platform)
        self._platforms_module._current_platform = platform
        self._platform.rebind(platform)
        _apply_triton_probe(spec_platform["device"])
        self._refresh_library_state()
        self._apply_distributed(spec["parallel"])

    def _apply_env(self, env: dict) -> None:
        stale = {k for k in os.environ if k.startswith("VLLM_")} | self._env_keys
        for key in stale:
            os.environ.pop(key, None)
        os.environ.update({str(k): str(v) for k, v in env.items()})
        self._env_keys = set(env)

    def _refresh_library_state(self) -> None:
        import vllm._aiter_ops as aiter_ops
        from vllm import envs

        for clear in self._cache_clearers:
            clear()
        if hasattr(envs.__getattr__, "cache_clear"):
            envs.__getattr__.cache_clear()
        aiter_ops.IS_AITER_FOUND = "aiter" in _MACHINE.packages
        aiter_ops.rocm_aiter_ops.refresh_env_variables()

    @staticmethod
    def _apply_distributed(parallel: dict) -> None:
        import vllm.distributed.parallel_state as ps

        tp = int(parallel.get("tensor_parallel_size") or 1)
        dp = int(parallel.get("data_parallel_size") or 1)
        ps._TP = _FakeGroup(tp)
        ps._DP = _FakeGroup(dp)
        ps._PCP = _FakeGroup(1)
        ps._EP = _FakeGroup(tp * dp)


# --------------------------------------------------------------------------------------
# Recording select_wna16_moe_backend where the MoE methods look it up.
# --------------------------------------------------------------------------------------


@dataclass
class _SelectCall:
    arguments: dict
    caller: str | None
    result: tuple | None = None
    error: BaseException | None = None


@dataclass
class _Run:
    """What one spec's pass through vLLM recorded."""

    calls: list[_SelectCall] = field(default_factory=list)
    method: Any = None
    quant_config_built: bool = False

    def reset(self) -> None:
        self.calls = []
        self.method = None
        self.quant_config_built = False


_RUN = _Run()


def _caller_class_name(frame: types.FrameType | None) -> str | None:
    caller_self = frame.f_locals.get("self") if frame is not None else None
    return type(caller_self).__name__ if caller_self is not None else None


def _install_select_recorder() -> None:
    import vllm.model_executor.layers.fused_moe.oracle.int_wna16 as iw

    real_select = iw.select_wna16_moe_backend
    signature = inspect.signature(real_select)

    @functools.wraps(real_select)
    def recording_select(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = _SelectCall(dict(bound.arguments), _caller_class_name(sys._getframe(1)))
        _RUN.calls.append(call)
        try:
            call.result = real_select(*args, **kwargs)
        except BaseException as exc:
            call.error = exc
            raise
        return call.result

    for namespace, name in _slots_holding(real_select):
        if namespace is not vars(iw):
            namespace[name] = recording_select


def _install_quant_config_marker() -> None:
    """Tell quant-config construction errors apart from the capability/dtype gates."""
    from vllm.model_executor.model_loader import weight_utils

    real = weight_utils.get_quant_config

    @functools.wraps(real)
    def marking_get_quant_config(*args: Any, **kwargs: Any) -> Any:
        quant_config = real(*args, **kwargs)
        _RUN.quant_config_built = True
        return quant_config

    weight_utils.get_quant_config = marking_get_quant_config


# --------------------------------------------------------------------------------------
# vLLM's path, per spec.
# --------------------------------------------------------------------------------------


class _VllmRaisedError(Exception):
    """vLLM raised along the path; carries the stage it raised in."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(stage)
        self.stage = stage
        self.error = error


class _StopAtWeightsError(Exception):
    """Raised in place of create_weights: the layer has its quant method by then."""


def _stop_before_weights(*_args: Any, **_kwargs: Any) -> None:
    raise _StopAtWeightsError


def _keep_sizes(hidden_size: int, intermediate_size: int, *_args: Any) -> tuple[int, int]:
    """Stands in for maybe_roundup_sizes: it runs after selection, changes nothing we
    report, and for all2all kernels needs their packages (e.g. deep_ep) installed."""
    return hidden_size, intermediate_size


def _dtype(name: str | None) -> Any:
    import torch

    if name in (None, ""):
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _model_config_stand_in(spec: dict) -> types.SimpleNamespace:
    """The attributes of ModelConfig that the quantization methods read."""
    from transformers import PretrainedConfig
    from vllm.config import ModelConfig
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    hf_config = PretrainedConfig()
    if spec.get("hf_quantization_config") is not None:
        hf_config.quantization_config = copy.deepcopy(spec["hf_quantization_config"])
    quant_cfg = ModelArchConfigConvertorBase._normalize_quantization_config(None, hf_config)
    return types.SimpleNamespace(
        model=f"spec-{spec.get('id')}",
        revision=None,
        hf_config=hf_config,
        hf_overrides={},
        model_arch_config=types.SimpleNamespace(
            quantization_config=quant_cfg,
            total_num_attention_heads=32,
            total_num_kv_heads=8,
        ),
        quantization=ModelConfig.validate_quantization_before(spec.get("quantization")),
        quantization_config=None,
        allow_deprecated_quantization=False,
        dtype=_dtype(spec["layer"].get("dtype")),
    )


def _resolve_quantization(model_config: types.SimpleNamespace) -> None:
    from vllm.config import ModelConfig

    try:
        ModelConfig._verify_quantization(model_config)
    except Exception as exc:
        raise _VllmRaisedError("quantization", exc) from exc


def _build_quant_config(model_config: types.SimpleNamespace) -> Any:
    from vllm.config import LoadConfig, VllmConfig

    try:
        return VllmConfig._get_quantization_config(model_config, LoadConfig())
    except Exception as exc:
        stage = "capability" if _RUN.quant_config_built else "quantization"
        raise _VllmRaisedError(stage, exc) from exc


_SERVE_PARSER: list[argparse.ArgumentParser] = []


def _serve_parser() -> argparse.ArgumentParser:
    """vLLM's own engine argument parser, as ``vllm serve`` builds it (once: it is slow).

    Its defaults read the current platform, so it is built with a spec's platform bound."""
    if not _SERVE_PARSER:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
        parser.exit_on_error = False
        _SERVE_PARSER.append(parser)
    return _SERVE_PARSER[0]


def _parse_moe_backend(spec: dict) -> str:
    """``--moe-backend`` as vLLM's parser converts and checks it."""
    try:
        args = _serve_parser().parse_args([f"--moe-backend={spec['moe_backend']}"])
    except argparse.ArgumentError as exc:
        raise _VllmRaisedError("kernel_config", exc) from exc
    return args.moe_backend


def _validate_environ() -> None:
    """``Platform.validate_environ`` with ``EngineArgs``' default ``hard_fail`` (off), as
    ``create_engine_config`` calls it before it builds the model config."""
    from vllm.platforms import current_platform

    validate = getattr(current_platform, "validate_environ", None)
    if validate is None:
        return
    try:
        validate(False)
    except Exception as exc:
        raise _VllmRaisedError("environment", exc) from exc


def _build_vllm_config(spec: dict, moe_backend: str) -> Any:
    from vllm.config import KernelConfig, LoRAConfig, ParallelConfig, VllmConfig

    parallel = spec["parallel"]
    kwargs = {
        "tensor_parallel_size": int(parallel.get("tensor_parallel_size") or 1),
        "data_parallel_size": int(parallel.get("data_parallel_size") or 1),
        "enable_expert_parallel": bool(parallel.get("enable_expert_parallel")),
        "enable_eplb": bool(parallel.get("enable_eplb")),
    }
    if parallel.get("all2all_backend") is not None:
        kwargs["all2all_backend"] = parallel["all2all_backend"]
    kernel_config = KernelConfig()
    if moe_backend != "auto":  # as EngineArgs.create_engine_config assigns it
        kernel_config.moe_backend = moe_backend
    parallel_config = ParallelConfig(**kwargs)
    try:
        vllm_config = VllmConfig(
            optimization_level=0,
            parallel_config=parallel_config,
            kernel_config=kernel_config,
        )
    except Exception as exc:  # the platform's check_and_update_config refused it
        raise _VllmRaisedError("platform", exc) from exc
    # LoRAConfig is verified against a ModelConfig, which the spec does not have.
    object.__setattr__(vllm_config, "lora_config", LoRAConfig() if spec.get("lora") else None)
    return vllm_config


def _probe_experts_cls() -> type:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    class ProbeRoutedExperts(RoutedExperts):
        """vLLM's RoutedExperts, stopped before it allocates the expert weights."""

        def _get_quant_method(self, prefix, quant_config, moe_config):
            method = super()._get_quant_method(prefix, quant_config, moe_config)
            _RUN.method = method
            method.maybe_roundup_sizes = _keep_sizes
            method.create_weights = _stop_before_weights
            return method

    return ProbeRoutedExperts


def _factory_kwargs(spec: dict, quant_config: Any) -> dict:
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    layer, routing = spec["layer"], spec["layer"]["routing"]
    activation = layer.get("activation") or "silu"
    gated = MoEActivation.from_str(activation).is_gated
    bias = None
    if routing.get("e_score_correction_bias"):
        bias = torch.zeros(int(layer["num_experts"]), dtype=torch.float32)
    return {
        "num_experts": int(layer["num_experts"]),
        "top_k": int(layer["top_k"]),
        "hidden_size": int(layer["hidden_size"]),
        "intermediate_size": int(layer["intermediate_size"]),
        "params_dtype": _dtype(layer.get("dtype")),
        "renormalize": bool(routing.get("renormalize", True)),
        "use_grouped_topk": bool(routing.get("use_grouped_topk")),
        "num_expert_group": routing.get("num_expert_group"),
        "topk_group": routing.get("topk_group"),
        "quant_config": quant_config,
        "prefix": layer["name"],
        "scoring_func": routing.get("scoring_func") or "softmax",
        "routed_scaling_factor": float(routing.get("routed_scaling_factor") or 1.0),
        "e_score_correction_bias": bias,
        "activation": activation,
        "enable_eplb": bool(spec["parallel"].get("enable_eplb")),
        "has_bias": bool(layer.get("has_bias")),
        "router_logits_dtype": _dtype(routing.get("router_logits_dtype")),
        "ckpt_names": ("gate_proj", "down_proj", "up_proj" if gated else None),
        "routed_experts_cls": _probe_experts_cls(),
    }


def _build_moe_method(spec: dict, moe_backend: str, quant_config: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    try:
        vllm_config = _build_vllm_config(spec, moe_backend)
        with set_current_vllm_config(vllm_config):
            FusedMoEFactory(**_factory_kwargs(spec, quant_config))
    except _VllmRaisedError:
        raise
    except _StopAtWeightsError:
        return _RUN.method
    except Exception as exc:
        raised_by_oracle = any(call.error is exc for call in _RUN.calls)
        raise _VllmRaisedError("backend" if raised_by_oracle else "moe_method", exc) from exc
    raise RuntimeError("FusedMoEFactory returned without creating expert weights")


# --------------------------------------------------------------------------------------
# Per-backend candidates, from vLLM's own functions.
# --------------------------------------------------------------------------------------


def _candidates(call: _SelectCall) -> Any:
    """Candidates in vLLM's order, the backend they select and the mode ('auto' etc.): the
    plugin's `moe_control_vllm.verdicts.judged` (the standard library only), the code the
    plugin reports with. Imported at the first answer, not when this module loads (the
    plugin tests load the plugin through vLLM after loading this), from the plugin vLLM's
    environment has, else this checkout's (a release's environment that records)."""
    import vllm.model_executor.layers.fused_moe.oracle.int_wna16 as iw

    if importlib.util.find_spec("moe_control_vllm") is None:
        sys.path.append(str(_PLUGIN))
    from moe_control_vllm.verdicts import judged

    return judged(iw, call.arguments)


def _check_consistency(call: _SelectCall, found: Any) -> None:
    """The real call and the recomputed candidates must tell the same story."""
    if found.experts_cls is not None:
        expected = (found.backend, found.experts_cls)
        if call.result != expected:
            raise AssertionError(f"vLLM selected {call.result}, candidates say {expected}")
        return
    expected_error = NotImplementedError if found.mode == "auto" else ValueError
    if type(call.error) is not expected_error:
        raise AssertionError(
            f"candidates say {expected_error.__name__} ({found.mode}); vLLM gave "
            f"{call.result if call.error is None else repr(call.error)}"
        )


# --------------------------------------------------------------------------------------
# Answers.
# --------------------------------------------------------------------------------------


def _weight_key_json(weight_key: Any) -> dict:
    group_shape = weight_key.scale.group_shape
    return {
        "dtype": str(weight_key.dtype),
        "scale_dtype": str(weight_key.scale.dtype).removeprefix("torch."),
        "group_shape": [int(group_shape[0]), int(group_shape[1])],
        "symmetric": bool(weight_key.symmetric),
    }


def _selection_fields(call: _SelectCall | None) -> dict:
    if call is None or call.result is None:
        return {
            "backend": None,
            "experts_class": None,
            "weight_key": None if call is None else _weight_key_json(call.arguments["weight_key"]),
        }
    backend, experts_cls = call.result
    return {
        "backend": backend.name,
        "experts_class": experts_cls.__name__,
        "weight_key": _weight_key_json(call.arguments["weight_key"]),
    }


def _oracle_inputs(call: _SelectCall | None) -> dict:
    keys = ("may_have_zp", "may_have_bias", "allow_tile_padding")
    if call is None:
        return dict.fromkeys(keys)
    return {key: bool(call.arguments[key]) for key in keys}


def _success(spec_id: Any, quantization: str | None, method: Any) -> dict:
    call = _RUN.calls[-1] if _RUN.calls else None
    candidates = _checked_candidates(call, None)
    selection = _selection_fields(call)
    return {
        "id": spec_id,
        "quantization": quantization,
        "moe_method": type(method).__name__,
        "backend": selection["backend"],
        "experts_class": selection["experts_class"],
        "weight_key": selection["weight_key"],
        **_oracle_inputs(call),
        "candidates": candidates,
    }


def _failure(spec_id: Any, quantization: str | None, failure: _VllmRaisedError) -> dict:
    call = _RUN.calls[-1] if _RUN.calls else None
    moe_method = type(_RUN.method).__name__ if _RUN.method is not None else None
    if call is not None:
        moe_method = moe_method or call.caller
    return {
        "id": spec_id,
        "quantization": quantization,
        "moe_method": moe_method,
        "error": {
            "stage": failure.stage,
            "type": type(failure.error).__name__,
            "message": str(failure.error),
        },
        "candidates": _checked_candidates(call, failure),
    }


def _checked_candidates(call: _SelectCall | None, failure: _VllmRaisedError | None) -> list[dict]:
    """Candidates for the recorded oracle call, checked against what it did."""
    if call is None:
        return []
    try:
        found = _candidates(call)
    except Exception as exc:
        # The oracle itself crashed (not a verdict): the same crash recomputing it.
        if failure is not None and type(exc) is type(call.error):
            return []
        raise
    _check_consistency(call, found)
    return [verdict._asdict() for verdict in found.verdicts]


def answer(world: _World, spec: dict) -> dict:
    """vLLM's answer for one spec (raises only on harness bugs)."""
    _RUN.reset()
    world.enter(spec)
    quantization = None
    try:
        moe_backend = _parse_moe_backend(spec)
        _validate_environ()
        model_config = _model_config_stand_in(spec)
        _resolve_quantization(model_config)
        quantization = model_config.quantization
        quant_config = _build_quant_config(model_config)
        method = _build_moe_method(spec, moe_backend, quant_config)
    except _VllmRaisedError as failure:
        return _failure(spec.get("id"), quantization, failure)
    return _success(spec.get("id"), quantization, method)


def _harness_error(spec_id: Any, exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(frames))
    summary = f"{type(exc).__name__}: {exc} (at {where})"
    return {"id": spec_id, "harness_error": summary[:2000]}


def _answer_line(world: _World, line: str) -> str:
    spec_id = None
    try:
        spec = json.loads(line)
        spec_id = spec.get("id")
        result = answer(world, spec)
    except Exception as exc:  # a harness bug must not stop the run
        result = _harness_error(spec_id, exc)
    return json.dumps(result)


def main() -> int:
    answers = _claim_stdout()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no checkpoint is ever fetched
    _import_decision_path()
    world = _World()
    _install_select_recorder()
    _install_quant_config_marker()
    for line in sys.stdin:
        if line.strip():
            answers.write(_answer_line(world, line) + "\n")
    answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
