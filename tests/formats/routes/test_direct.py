"""The direct packed -> packed routes give the canonical route's bytes, or step aside.

Every variant builds a random layer, stores it in a checkpoint layout with our own packers,
and converts it both ways: `direct.try_direct` must answer (where `ROUTES` covers the
variant) with the same tensor names in the same order, dtypes, shapes, bytes and descriptor
as `direct.canonical` (reader -> canonical -> writer, the route the vLLM exactness tests
check). Variants a route does not cover must take the canonical route through
`direct.convert`, errors included.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import ConversionUnsupported, FormatError
from service.formats.readers import LAYOUTS, SourceQuantization, write_checkpoint
from service.formats.routes import direct, read, transforms, uniform_read
from service.formats.routes.canonical import canonical
from service.formats.routes.convert import convert
from service.formats.routes.packed import PackedLayer
from service.formats.synthetic.quantize import act_order_g_idx
from service.formats.writers import ConversionOptions, ConvertedLayer

E, H, INTER = 2, 256, 128


def _experts(
    n: int,
    k: int,
    *,
    bits: int,
    group: int,
    sym: bool,
    bias: bool,
    dtype: torch.dtype,
    act: bool,
    gen: torch.Generator,
) -> QuantizedExperts:
    groups = 1 if group == -1 else k // group
    codes = torch.randint(0, 1 << bits, (E, n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(E, n, groups, generator=gen) + 0.01).to(dtype)
    zeros = None
    if not sym:
        # GPTQ v1 cannot store a zero point of 0 (it stores zero - 1).
        zeros = torch.randint(1, 1 << bits, (E, n, groups), dtype=torch.uint8, generator=gen)
    g_idx = act_order_g_idx(E, k, group, gen) if act else None
    bias_t = torch.randn(E, n, generator=gen).to(dtype) if bias else None
    return QuantizedExperts(codes, scales, bits, group, zeros, g_idx, bias_t)


def _checkpoint(
    layout: str,
    *,
    bits: int = 4,
    group: int = 64,
    sym: bool = True,
    bias: bool = False,
    dtype: torch.dtype = torch.float16,
    act: bool = False,
    inter: int = INTER,
    gated: bool = True,
    naming: str = "mixtral",
    seed: int = 0,
    v2: bool = False,
) -> tuple[dict[str, torch.Tensor], SourceQuantization]:
    gen = torch.Generator().manual_seed(seed)
    kw = {"bits": bits, "group": group, "sym": sym, "bias": bias, "dtype": dtype, "act": act}
    layer = QuantizedMoELayer(
        w13=_experts((2 if gated else 1) * inter, H, gen=gen, **kw),  # type: ignore[arg-type]
        w2=_experts(H, inter, gen=gen, **kw),  # type: ignore[arg-type]
    )
    quant = SourceQuantization(bits=bits, group_size=group, symmetric=sym, desc_act=act, gptq_v2=v2)
    tensors = write_checkpoint(LAYOUTS[layout], layer, quant, naming=naming, gated=gated)
    return tensors, quant


def _same(a: ConvertedLayer, b: ConvertedLayer) -> None:
    assert list(a.tensors) == list(b.tensors)
    assert a.descriptor == b.descriptor
    for name in a.tensors:
        x, y = a.tensors[name], b.tensors[name]
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), name
        assert x.is_contiguous(), name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


def _routes(layout: str, backend: str, bits: int) -> bool:
    return direct.direct_route(layout, backend, bits) is not None


# The grid: every source layout x both targets x 4/8 bit x channelwise and grouped x
# symmetric/asymmetric; bias, scale dtype and naming vary along with the group size.
GRID = [
    pytest.param(
        layout,
        backend,
        bits,
        group,
        sym,
        id=f"{layout}-{backend}-int{bits}-g{group}-{'sym' if sym else 'asym'}",
    )
    for layout, backend, bits, group, sym in itertools.product(
        ("gptq", "awq", "compressed-tensors", "moe_wna16"),
        ("TRITON", "MARLIN"),
        (4, 8),
        (-1, 32, 128),
        (True, False),
    )
]


@pytest.mark.parametrize(("layout", "backend", "bits", "group", "sym"), GRID)
def test_direct_equals_canonical(
    layout: str, backend: str, bits: int, group: int, sym: bool
) -> None:
    tensors, quant = _checkpoint(
        layout,
        bits=bits,
        group=group,
        sym=sym,
        bias=group != 32,
        dtype=torch.bfloat16 if group == 128 else torch.float16,
        naming="hf" if sym else "mixtral",
        seed=bits * 1000 + group,
    )
    got = direct.try_direct(layout, tensors, quant, backend, num_experts=E)
    want = canonical(layout, tensors, quant, backend, num_experts=E)
    if not _routes(layout, backend, bits):
        assert got is None
        return
    assert got is not None, "a route exists for this pair: it must take this plain layer"
    _same(got, want)
    _same(convert(layout, tensors, quant, backend, num_experts=E), want)


def test_every_hot_route_is_in_the_table() -> None:
    """The routes the brief names are direct, for 4-bit (the Mixtral checkpoints) at least."""
    for layout, backend in itertools.product(("gptq", "awq", "compressed-tensors"), ("TRITON",)):
        assert _routes(layout, backend, 4)
    for layout in ("gptq", "awq"):
        assert _routes(layout, "MARLIN", 4)
        assert _routes(layout, "BATCHED_MARLIN", 4)
    assert _routes("gptq", "MARLIN", 8) and not _routes("moe_wna16", "MARLIN", 4)


Variant = Callable[[], tuple[dict[str, torch.Tensor], SourceQuantization, dict[str, object]]]

# (layout, backend, build, direct expected): the shapes and options beyond the grid.
SPECIAL: dict[str, tuple[str, str, Variant, bool]] = {
    "gptq-v2-asym-marlin": (
        "gptq",
        "MARLIN",
        lambda: (*_checkpoint("gptq", sym=False, v2=True), {}),
        True,
    ),
    "gptq-nongated-triton": (
        "gptq",
        "TRITON",
        lambda: (*_checkpoint("gptq", gated=False), {"gated": False}),
        True,
    ),
    "awq-nongated-marlin": (
        "awq",
        "MARLIN",
        lambda: (*_checkpoint("awq", gated=False, sym=False), {"gated": False}),
        True,
    ),
    "awq-batched-marlin": (
        "awq",
        "BATCHED_MARLIN",
        lambda: (*_checkpoint("awq", group=128, bias=True), {}),
        True,
    ),
    "ct-int8-batched-marlin-channelwise": (
        "compressed-tensors",
        "BATCHED_MARLIN",
        lambda: (*_checkpoint("compressed-tensors", bits=8, group=-1, sym=False), {}),
        True,
    ),
    "gptq-device-option": (
        "gptq",
        "MARLIN",
        lambda: (*_checkpoint("gptq"), {"options": ConversionOptions(device="cpu")}),
        True,
    ),
    # Marlin pads I=96 to 128 (lcm(64, 32)): the canonical writer's job.
    "gptq-marlin-padded": (
        "gptq",
        "MARLIN",
        lambda: (*_checkpoint("gptq", group=32, inter=96), {}),
        False,
    ),
    "awq-marlin-int8-activations": (
        "awq",
        "MARLIN",
        lambda: (
            *_checkpoint("awq"),
            {"options": ConversionOptions(activation_dtype=torch.int8, ruleset="vllm-0.33")},
        ),
        False,
    ),
    "gptq-act-order-marlin-sorted": (
        "gptq",
        "MARLIN",
        lambda: (
            *_checkpoint("gptq", act=True, group=32),
            {"options": ConversionOptions(extra={"act_order": "sort"})},
        ),
        False,
    ),
    "ct-act-order-marlin-sorted-int8": (
        "compressed-tensors",
        "MARLIN",
        lambda: (
            *_checkpoint("compressed-tensors", bits=8, act=True, group=64, sym=False),
            {"options": ConversionOptions(extra={"act_order": "sort"})},
        ),
        False,
    ),
    "awq-int8-triton": ("awq", "TRITON", lambda: (*_checkpoint("awq", bits=8), {}), False),
    # act-order stored but trivial (GPTQ always writes g_idx): dropped, so direct.
    "gptq-trivial-g_idx-triton": (
        "gptq",
        "TRITON",
        lambda: (*_checkpoint("gptq", group=128, sym=False, bias=True), {}),
        True,
    ),
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_special_variants(name: str) -> None:
    layout, backend, build, takes_direct = SPECIAL[name]
    tensors, quant, kwargs = build()
    got = direct.try_direct(layout, tensors, quant, backend, num_experts=E, **kwargs)  # type: ignore[arg-type]
    want = canonical(layout, tensors, quant, backend, num_experts=E, **kwargs)  # type: ignore[arg-type]
    assert (got is not None) == takes_direct
    _same(convert(layout, tensors, quant, backend, num_experts=E, **kwargs), want)  # type: ignore[arg-type]
    if got is not None:
        _same(got, want)


@pytest.mark.parametrize("backend", ["TRITON", "MARLIN"])
def test_refusals_are_the_canonical_routes(backend: str) -> None:
    """Act-order weights: TRITON and (without act_order=sort) MARLIN refuse them, with the
    canonical writer's words."""
    tensors, quant = _checkpoint("gptq", act=True, group=32)
    with pytest.raises(ConversionUnsupported) as canonical_error:
        canonical("gptq", tensors, quant, backend, num_experts=E)
    with pytest.raises(ConversionUnsupported) as error:
        convert("gptq", tensors, quant, backend, num_experts=E)
    assert str(error.value) == str(canonical_error.value)


def _corrupt(tensors: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    if how == "dtype":
        out["0.w1.qweight"] = out["0.w1.qweight"].to(torch.int64)
    elif how == "shape":
        out["1.w2.qweight"] = out["1.w2.qweight"][:-1]
    elif how == "missing":
        del out["1.w3.scales"]
    elif how == "unknown":
        out["0.w1.qweightt"] = out.pop("0.w1.qweight")
    elif how == "sym-zero":
        # declared symmetric, but one stored zero point is not the midpoint
        zeros = out["1.w2.qzeros"].clone()
        zeros[0, 0] = 0x77777778
        out["1.w2.qzeros"] = zeros
    elif how == "g_idx-range":
        g_idx = out["0.w3.g_idx"].clone()
        g_idx[0] = 1000
        out["0.w3.g_idx"] = g_idx
    elif how == "asym-zero":
        # a GPTQ v1 stored zero of 15 means 16: not representable
        out["0.w1.qzeros"] = torch.full_like(out["0.w1.qzeros"], -1)
    return out


@pytest.mark.parametrize(
    "how", ["dtype", "shape", "missing", "unknown", "asym-zero", "sym-zero", "g_idx-range"]
)
def test_bad_input_gets_the_canonical_error(how: str) -> None:
    tensors, quant = _checkpoint("gptq", sym=how == "sym-zero")
    bad = _corrupt(tensors, how)
    with pytest.raises(FormatError) as canonical_error:
        canonical("gptq", bad, quant, "MARLIN", num_experts=E)
    with pytest.raises(FormatError) as error:
        convert("gptq", bad, quant, "MARLIN", num_experts=E)
    assert (error.value.field, str(error.value)) == (
        canonical_error.value.field,
        str(canonical_error.value),
    )


def test_exchange_nibbles_pairs_low_and_high() -> None:
    """The one arithmetic step the routes share, on words whose nibbles are their own
    positions: a = 0x76543210, b = 0xFEDCBA98."""
    a = torch.tensor([0x76543210], dtype=torch.int32)
    b = torch.tensor([0xFEDCBA98 - (1 << 32)], dtype=torch.int32)
    low, high = torch.empty_like(a), torch.empty_like(a)
    transforms.exchange_nibbles(a, b, low, high)
    assert int(low) & 0xFFFFFFFF == 0xE6C4A280
    assert int(high) & 0xFFFFFFFF == 0xF7D5B391


@pytest.mark.parametrize("layout", ["gptq", "awq", "compressed-tensors"])
@pytest.mark.parametrize("sym", [True, False])
def test_gpu_block_moves_on_the_cpu(
    layout: str, sym: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strided-copy byte moves a GPU runs (the CPU takes numpy's table path) give the
    same bytes."""
    monkeypatch.setattr(transforms, "TABLE_MOVE_DEVICES", set())
    tensors, quant = _checkpoint(layout, sym=sym, group=128, bias=not sym)
    for backend in ("MARLIN", "TRITON"):
        got = direct.try_direct(layout, tensors, quant, backend, num_experts=E)
        assert got is not None
        _same(got, canonical(layout, tensors, quant, backend, num_experts=E))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["gptq", "awq", "compressed-tensors"])
@pytest.mark.parametrize("backend", ["TRITON", "MARLIN"])
def test_direct_on_the_gpu_equals_canonical_on_the_cpu(layout: str, backend: str) -> None:
    for sym, bits in ((True, 4), (False, 4), (False, 8)):
        tensors, quant = _checkpoint(layout, sym=sym, bits=bits, group=128, bias=True)
        on_gpu = {name: t.to("cuda") for name, t in tensors.items()}
        got = direct.try_direct(layout, on_gpu, quant, backend, num_experts=E)
        if got is None:
            assert not _routes(layout, backend, bits)
            continue
        want = canonical(layout, tensors, quant, backend, num_experts=E)
        on_cpu = ConvertedLayer({n: t.cpu() for n, t in got.tensors.items()}, got.descriptor)
        _same(on_cpu, want)


def _fields(layer: PackedLayer) -> list[tuple[str, torch.Tensor | None]]:
    out: list[tuple[str, torch.Tensor | None]] = []
    for name, p in (("w13", layer.w13), ("w2", layer.w2)):
        out += [(f"{name}.scales", p.scales), (f"{name}.zeros", p.zeros)]
        out += [(f"{name}.g_idx", p.g_idx), (f"{name}.bias", p.bias)]
    return out


@pytest.mark.parametrize(
    ("layout", "bits", "sym", "gated"),
    [
        ("gptq", 4, True, True),
        ("gptq", 8, False, True),
        ("awq", 4, False, False),
        ("compressed-tensors", 4, False, True),
        ("moe_wna16", 8, True, True),
    ],
)
def test_uniform_read_is_the_general_read(
    layout: str, bits: int, sym: bool, gated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read_packed`'s one-stack, one-sync read of a uniform layer gives the same layer as
    the per-projection read it short-cuts (taken here by turning the short cut off)."""
    tensors, quant = _checkpoint(layout, bits=bits, sym=sym, gated=gated, bias=True)
    taken: list[object] = []
    uniform = read.read_uniform

    def spy(*args: object, **kwargs: object) -> object:
        taken.append(uniform(*args, **kwargs))  # type: ignore[arg-type]
        return taken[-1]

    monkeypatch.setattr(read, "read_uniform", spy)
    fast = read.read_packed(LAYOUTS[layout], tensors, quant, num_experts=E, gated=gated)
    assert taken and taken[-1] is fast
    monkeypatch.setattr(read, "read_uniform", lambda *a, **k: None)
    general = read.read_packed(LAYOUTS[layout], tensors, quant, num_experts=E, gated=gated)
    for p, q in ((fast.w13, general.w13), (fast.w2, general.w2)):
        assert (p.n, p.k, p.bits, p.group_size, p.num_groups) == (
            q.n,
            q.k,
            q.bits,
            q.group_size,
            q.num_groups,
        )
        assert [[id(t) for t in s] for s in p.weights] == [[id(t) for t in s] for s in q.weights]
    for (name, x), (_, y) in zip(_fields(fast), _fields(general), strict=True):
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            assert (x.dtype, x.shape) == (y.dtype, y.shape), name
            assert x.is_contiguous() and torch.equal(x, y), name


def _vary(tensors: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    """Layers the uniform read declines (or reads through strided views): the general
    read then decides, and `convert` must still be the canonical route, errors included."""
    out = dict(tensors)
    if how == "g_idx-int64-one-expert":
        out["1.w2.g_idx"] = out["1.w2.g_idx"].to(torch.int64)
    elif how == "up-scales-bf16":
        for e in range(E):
            out[f"{e}.w3.scales"] = out[f"{e}.w3.scales"].to(torch.bfloat16)
    elif how == "w2-scales-bf16":
        for e in range(E):
            out[f"{e}.w2.scales"] = out[f"{e}.w2.scales"].to(torch.bfloat16)
    elif how == "strided-scales":
        for key in [k for k in out if k.endswith(".scales")]:
            out[key] = out[key].t().contiguous().t()
    elif how == "no-zeros-on-w2":
        for e in range(E):
            del out[f"{e}.w2.qzeros"]
    elif how == "g_idx-not-plain":
        g_idx = out["1.w1.g_idx"].clone()
        g_idx[:64] = g_idx[:64].flip(0)
        out["1.w1.g_idx"] = g_idx
    return out


@pytest.mark.parametrize(
    "how",
    [
        "g_idx-int64-one-expert",
        "up-scales-bf16",
        "w2-scales-bf16",
        "strided-scales",
        "no-zeros-on-w2",
        "g_idx-not-plain",
    ],
)
@pytest.mark.parametrize("backend", ["TRITON", "MARLIN"])
def test_non_uniform_layers_take_the_general_read(how: str, backend: str) -> None:
    tensors, quant = _checkpoint("gptq")
    varied = _vary(tensors, how)
    try:
        want = canonical("gptq", varied, quant, backend, num_experts=E)
    except (FormatError, ConversionUnsupported) as canonical_error:
        with pytest.raises(type(canonical_error)) as error:
            convert("gptq", varied, quant, backend, num_experts=E)
        assert str(error.value) == str(canonical_error)
        if isinstance(canonical_error, FormatError):
            assert isinstance(error.value, FormatError)
            assert error.value.field == canonical_error.field
        return
    _same(convert("gptq", varied, quant, backend, num_experts=E), want)


def _syncs(run: Callable[[], object]) -> int:
    """How many synchronizing CUDA calls `run` makes (torch's sync debug mode warns on each:
    `.item()`/`bool()` of a device tensor, a copy from pageable memory...)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("layout", "syncs"), [("gptq", 1), ("awq", 0)])
@pytest.mark.parametrize("backend", ["TRITON", "MARLIN"])
def test_one_host_sync_per_layer_on_the_gpu(layout: str, syncs: int, backend: str) -> None:
    """GPTQ's zero-point and g_idx checks cost the layer one host sync (AWQ has none to
    check), read and conversion through the kernels together (their pointer tables are
    copied without one); caches warmed by a first call."""
    tensors, quant = _checkpoint(layout, group=128)
    on_gpu = {name: t.to("cuda") for name, t in tensors.items()}

    def read_only() -> object:
        return read.read_packed(LAYOUTS[layout], on_gpu, quant, num_experts=E)

    def whole() -> object:
        return direct.try_direct(layout, on_gpu, quant, backend, num_experts=E, kernels=True)

    # Warm both paths: the per-shape device caches (`_shape_words`, `_plain_groups`, the
    # gather indices, the kernels' pointer tables) are made on first use.
    whole()
    read_only()
    # Counted in the steady state: on the H200 the first counted call of a process saw one
    # synchronizing call more than every later one (whatever ran before it), so one
    # counted round is a warm-up too.
    _syncs(read_only)
    _syncs(whole)
    assert _syncs(read_only) == syncs
    assert _syncs(whole) == syncs


@pytest.fixture
def deferring(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Content checks deferred on the CPU too (as on a GPU); the order in which the weight
    writes and the checks' sync ran, from now on."""
    monkeypatch.setattr(uniform_read, "DEFER_DEVICES", {"cuda", "cpu"})
    events: list[str] = []
    write, holds = direct.write_weight, uniform_read.content_holds

    def spy_write(*args: Any, **kwargs: Any) -> torch.Tensor:
        events.append("write")
        return write(*args, **kwargs)

    def spy_holds(*args: Any, **kwargs: Any) -> bool:
        events.append("check")
        return holds(*args, **kwargs)

    monkeypatch.setattr(direct, "write_weight", spy_write)
    monkeypatch.setattr(uniform_read, "content_holds", spy_holds)
    return events


@pytest.mark.parametrize("backend", ["TRITON", "MARLIN"])
def test_deferred_checks_run_after_the_weight_writes(backend: str, deferring: list[str]) -> None:
    """GPTQ's zero-point and g_idx checks wait until both weights are queued; same bytes."""
    tensors, quant = _checkpoint("gptq", group=128)
    want = canonical("gptq", tensors, quant, backend, num_experts=E)
    deferring.clear()
    got = direct.try_direct("gptq", tensors, quant, backend, num_experts=E)
    assert got is not None
    _same(got, want)
    assert deferring == ["write", "write", "check"]


@pytest.mark.parametrize("name", sorted(SPECIAL))
def test_special_variants_with_deferred_checks(name: str, deferring: list[str]) -> None:
    """A layer whose deferred checks fail (act-order g_idx) is read again the general way:
    the same answer as without deferral."""
    test_special_variants(name)


@pytest.mark.parametrize("how", ["asym-zero", "sym-zero", "g_idx-range"])
def test_bad_content_with_deferred_checks(how: str, deferring: list[str]) -> None:
    """Content the deferred check refuses gets the canonical route's error, after the
    weights were written and dropped."""
    test_bad_input_gets_the_canonical_error(how)
    assert "write" in deferring or how == "g_idx-range"
