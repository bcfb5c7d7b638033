"""Readers and their inverses: packing conventions, round trips, and bad input.

The convention tests pin each layout's bit order with hand-computed words, so a reader and its
packer cannot agree with each other while both being wrong; the exactness suite
(`test_exactness.py`) then checks the same conventions against vLLM 0.33.0's own code.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest
import torch

from service.formats.canonical import QuantizedExperts, QuantizedMoELayer
from service.formats.errors import FormatError
from service.formats.readers import (
    LAYOUTS,
    SourceQuantization,
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    pack_moe_wna16,
    write_checkpoint,
    write_stacked,
)
from service.formats.registry import read_layer, read_stacked_layer
from service.formats.synthetic.quantize import random_layer

E, H, INTER = 3, 256, 128


def _one(codes: list[int], bits: int = 4, zeros: int | None = None) -> QuantizedExperts:
    """One expert, one output row... transposed as needed by the caller's layout."""
    k = len(codes)
    return QuantizedExperts(
        codes=torch.tensor(codes, dtype=torch.uint8).reshape(1, 1, k).repeat(1, 8, 1),
        scales=torch.ones(1, 8, 1, dtype=torch.float16),
        bits=bits,
        group_size=-1,
        zeros=None if zeros is None else torch.full((1, 8, 1), zeros, dtype=torch.uint8),
    )


def _word(value: int) -> int:
    """An unsigned 32-bit pattern as the int32 torch stores."""
    return value - (1 << 32) if value >= 1 << 31 else value


# -- conventions ---------------------------------------------------------------------------


def test_gptq_packs_k_lowest_nibble_first_and_stores_zero_minus_one() -> None:
    packed = pack_gptq(_one([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], zeros=8))
    assert packed["qweight"].dtype == torch.int32
    assert packed["qweight"].shape == (2, 8)  # [K/8, N]
    assert packed["qweight"][0, 0] == 0x76543210
    assert packed["qweight"][1, 0] == _word(0xFEDCBA98)
    assert packed["qzeros"].shape == (1, 1)  # [G, N/8]
    assert packed["qzeros"][0, 0] == 0x77777777  # real 8, stored 7 (v1)
    assert packed["g_idx"].tolist() == [0] * 16


def test_gptq_symmetric_stores_the_midpoint_minus_one() -> None:
    assert pack_gptq(_one([0] * 8))["qzeros"][0, 0] == 0x77777777
    assert pack_gptq(_one([0] * 8), v2=True)["qzeros"][0, 0] == _word(0x88888888)
    assert pack_gptq(_one([0] * 4, bits=8))["qzeros"][0, 0] == 0x7F7F7F7F


def test_awq_packs_n_in_its_interleaved_order() -> None:
    # Row k of an AWQ qweight packs N; make column n hold code n.
    q = QuantizedExperts(
        codes=torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1).repeat(1, 1, 32),
        scales=torch.ones(1, 8, 1, dtype=torch.float16),
        bits=4,
        group_size=-1,
        zeros=torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1) + 1,
    )
    packed = pack_awq(q)
    assert packed["qweight"].shape == (32, 1)  # [K, N/8]
    # nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert packed["qweight"][0, 0] == 0x75316420
    assert packed["qzeros"][0, 0] == _word(0x86427531)  # real zero points, same order


def test_compressed_tensors_is_n_first_and_zero_points_pack_along_n() -> None:
    q = QuantizedExperts(
        codes=torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8).repeat(1, 8, 1),
        scales=torch.ones(1, 8, 1, dtype=torch.float16),
        bits=4,
        group_size=-1,
        zeros=torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1) + 1,
    )
    packed = pack_compressed_tensors(q)
    assert packed["weight_packed"].shape == (8, 1)  # [N, K/8]
    assert packed["weight_packed"][0, 0] == 0x76543210
    assert packed["weight_zero_point"].shape == (1, 1)  # [N/8, G]
    assert packed["weight_zero_point"][0, 0] == _word(0x87654321)
    assert packed["weight_shape"].tolist() == [8, 8]
    assert "weight_g_idx" not in packed


def test_moe_wna16_is_uint8_n_first_even_index_low() -> None:
    q = QuantizedExperts(
        codes=torch.tensor([1, 2, 3, 4], dtype=torch.uint8).reshape(1, 1, 4).repeat(1, 2, 1),
        scales=torch.ones(1, 2, 1, dtype=torch.float16),
        bits=4,
        group_size=-1,
        zeros=torch.tensor([5, 6], dtype=torch.uint8).reshape(1, 2, 1),
    )
    packed = pack_moe_wna16(q)
    assert packed["qweight"].dtype == torch.uint8
    assert packed["qweight"][0].tolist() == [0x21, 0x43]
    assert packed["qzeros"].tolist() == [[0x65]]


def _quark_row() -> QuantizedExperts:
    """Eight output columns, column n holding code n + 4 (so -4..3 as signed int4)."""
    return QuantizedExperts(
        codes=(torch.arange(8, dtype=torch.uint8) + 4).reshape(1, 8, 1).repeat(1, 1, 32),
        scales=torch.ones(1, 8, 1, dtype=torch.float16),
        bits=4,
        group_size=-1,
    )


def test_quark_reorder_packs_n_in_awq_order_with_signed_symmetric_codes() -> None:
    quant = SourceQuantization(4, -1, symmetric=True)
    packed = LAYOUTS["quark"].encode(_quark_row(), quant)
    assert packed["weight"].shape == (1, 32, 1)  # [E, K, N/8], int32 packed along N
    # nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]; code c is stored as c ^ 8
    # (two's complement of c - 8): columns 0..7 hold codes 4..11, stored C, D, E, F, 0..3
    assert packed["weight"][0, 0, 0] == 0x31FD20EC
    assert "zeros" not in packed
    ordered = LAYOUTS["quark-order"].encode(_quark_row(), quant)
    assert ordered["weight"][0, 0, 0] == 0x3210FEDC  # nibble i holds column i


def test_quark_asymmetric_codes_and_zero_points_are_stored_as_they_are() -> None:
    row = _quark_row()
    row = QuantizedExperts(
        codes=row.codes,
        scales=row.scales,
        bits=4,
        group_size=-1,
        zeros=torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1) + 1,
    )
    packed = LAYOUTS["quark"].encode(row, SourceQuantization(4, -1, symmetric=False))
    assert packed["weight"][0, 0, 0] == _word(0xB975A864)
    assert packed["zeros"][0, 0, 0] == _word(0x86427531)  # [E, G, N/8], AWQ order


def test_quark_symmetric_zero_points_are_dropped_unread() -> None:
    quant = SourceQuantization(4, -1, symmetric=True)
    packed = LAYOUTS["quark"].encode(_quark_row(), quant)
    # A symmetric export may carry any zero points: vLLM loads and never reads them.
    packed["zeros"] = torch.full((1, 1, 1), 0x12345678, dtype=torch.int32)
    fields = {role: role for role in LAYOUTS["quark"].roles}
    back = LAYOUTS["quark"].decode(packed, quant, fields)
    assert back.zeros is None
    assert torch.equal(back.codes, _quark_row().codes)


def test_quark_has_no_expert_bias_or_8_bit_weights() -> None:
    seed = torch.Generator().manual_seed(0)
    layer = random_layer(
        1, 64, 32, bits=4, group_size=32, symmetric=True, bias=True, generator=seed
    )
    with pytest.raises(FormatError, match="no expert bias"):
        LAYOUTS["quark"].encode(layer.w2, SourceQuantization(4, 32))
    wide = random_layer(1, 64, 32, bits=8, group_size=32, symmetric=True, generator=seed)
    with pytest.raises(FormatError, match=r"\(4,\)-bit"):
        LAYOUTS["quark"].encode(wide.w2, SourceQuantization(8, 32))


# -- round trips -------------------------------------------------------------------------


def _combos() -> list[tuple[str, int, int, bool, bool, bool]]:
    out = []
    for layout, bits, group, sym, act, bias in itertools.product(
        sorted(LAYOUTS), (4, 8), (32, 64, 128, -1), (True, False), (False, True), (False, True)
    ):
        names = LAYOUTS[layout].names
        if (act and "g_idx" not in names) or (bias and "bias" not in names):
            continue
        if bits not in LAYOUTS[layout].supported_bits:
            continue
        out.append((layout, bits, group, sym, act, bias))
    return out


def _assert_same(a: QuantizedMoELayer, b: QuantizedMoELayer) -> None:
    for name in ("w13", "w2"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.codes, y.codes), name
        assert torch.equal(x.scales, y.scales), name
        for attr in ("zeros", "g_idx", "bias"):
            u, v = getattr(x, attr), getattr(y, attr)
            assert (u is None) == (v is None), (name, attr)
            assert u is None or torch.equal(u, v), (name, attr)
        assert torch.equal(x.dequantize(), y.dequantize())


COMBOS = _combos()


@pytest.mark.parametrize("case", COMBOS, ids=["-".join(map(str, c)) for c in COMBOS])
def test_round_trip_per_expert_and_stacked(case: tuple[str, int, int, bool, bool, bool]) -> None:
    layout, bits, group, sym, act, bias = case
    layer = random_layer(
        E,
        H,
        INTER,
        bits=bits,
        group_size=group,
        symmetric=sym,
        generator=torch.Generator().manual_seed(COMBOS.index(case)),
        act_order=act,
        bias=bias,
    )
    quant = SourceQuantization(bits, group, sym, desc_act=act)
    checkpoint = write_checkpoint(LAYOUTS[layout], layer, quant)
    _assert_same(layer, read_layer(layout, checkpoint, quant, num_experts=E))
    stacked = write_stacked(LAYOUTS[layout], layer, quant)
    _assert_same(layer, read_stacked_layer(layout, stacked, quant))


@pytest.mark.parametrize("naming", ["hf", "mixtral"])
@pytest.mark.parametrize("gated", [True, False])
def test_namings_and_non_gated(naming: str, gated: bool) -> None:
    layer = random_layer(
        2,
        128,
        64,
        bits=4,
        group_size=32,
        symmetric=False,
        generator=torch.Generator(),
        gated=gated,
    )
    quant = SourceQuantization(4, 32, False)
    checkpoint = write_checkpoint(LAYOUTS["gptq"], layer, quant, naming=naming, gated=gated)
    first = {"hf": "gate_proj" if gated else "up_proj", "mixtral": "w1"}[naming]
    assert f"1.{first}.qweight" in checkpoint
    _assert_same(layer, read_layer("gptq", checkpoint, quant, num_experts=2, gated=gated))


def test_gptq_v2_zero_points_are_stored_as_is() -> None:
    layer = random_layer(
        2, 128, 64, bits=4, group_size=32, symmetric=False, generator=torch.Generator()
    )
    v1 = SourceQuantization(4, 32, False)
    v2 = SourceQuantization(4, 32, False, gptq_v2=True)
    ck1 = write_checkpoint(LAYOUTS["gptq"], layer, v1)
    ck2 = write_checkpoint(LAYOUTS["gptq"], layer, v2)
    assert not torch.equal(ck1["0.gate_proj.qzeros"], ck2["0.gate_proj.qzeros"])
    _assert_same(layer, read_layer("gptq", ck2, v2, num_experts=2))


# -- bad input ---------------------------------------------------------------------------


def _gptq_checkpoint(sym: bool = False, act: bool = False) -> dict[str, torch.Tensor]:
    layer = random_layer(
        2,
        128,
        64,
        bits=4,
        group_size=32,
        symmetric=sym,
        generator=torch.Generator(),
        act_order=act,
    )
    return write_checkpoint(LAYOUTS["gptq"], layer, SourceQuantization(4, 32, sym, act))


ASYM = SourceQuantization(4, 32, symmetric=False)


def _expect(
    field: str,
    tensors: Mapping[str, torch.Tensor],
    quant: SourceQuantization = ASYM,
    layout: str = "gptq",
) -> None:
    with pytest.raises(FormatError) as caught:
        read_layer(layout, tensors, quant, num_experts=2)
    assert caught.value.field == field, str(caught.value)


def test_wrong_dtype_names_the_tensor() -> None:
    ck = _gptq_checkpoint()
    ck["1.up_proj.qweight"] = ck["1.up_proj.qweight"].float()
    _expect("1.up_proj.qweight", ck)


def test_wrong_shape_names_the_tensor() -> None:
    ck = _gptq_checkpoint()
    ck["0.down_proj.scales"] = ck["0.down_proj.scales"][:, :-1]
    _expect("0.down_proj.scales", ck)


def test_wrong_scale_dtype_names_the_tensor() -> None:
    ck = _gptq_checkpoint()
    ck["1.gate_proj.scales"] = ck["1.gate_proj.scales"].to(torch.int16)
    _expect("1.gate_proj.scales", ck)


def test_unknown_tensor_projection_and_expert() -> None:
    ck = _gptq_checkpoint()
    _expect("0.gate_proj.weight_scale", {**ck, "0.gate_proj.weight_scale": torch.ones(1)})
    _expect("0.fc1.qweight", {**ck, "0.fc1.qweight": torch.ones(1)})
    _expect("2.gate_proj.qweight", {**ck, "2.gate_proj.qweight": ck["0.gate_proj.qweight"]})
    _expect("gate_proj.qweight", {**ck, "gate_proj.qweight": ck["0.gate_proj.qweight"]})
    _expect("0.w1.qweight", {**ck, "0.w1.qweight": ck["0.gate_proj.qweight"]})


def test_missing_tensors() -> None:
    ck = _gptq_checkpoint()
    del ck["1.down_proj.qzeros"]
    _expect("1.down_proj.qzeros", ck)
    ck = {k: v for k, v in _gptq_checkpoint().items() if not k.endswith("up_proj.scales")}
    _expect("0.up_proj.scales", ck)
    ck = {k: v for k, v in _gptq_checkpoint(act=True).items() if not k.endswith(".g_idx")}
    _expect("0.gate_proj.g_idx", ck, SourceQuantization(4, 32, False, desc_act=True))


def test_symmetric_declared_but_zero_points_say_otherwise() -> None:
    _expect("gate_proj.qzeros", _gptq_checkpoint(sym=False), SourceQuantization(4, 32, True))


def test_gptq_v1_zero_point_of_fifteen_is_refused() -> None:
    ck = _gptq_checkpoint()
    ck["0.down_proj.qzeros"] = torch.full_like(ck["0.down_proj.qzeros"], -1)  # all nibbles 15
    _expect("down_proj.qzeros", ck)


def test_group_count_and_g_idx_range() -> None:
    _expect("gate_proj.scales", _gptq_checkpoint(), SourceQuantization(4, 64, False))
    ck = _gptq_checkpoint()
    ck["0.gate_proj.g_idx"] = torch.full_like(ck["0.gate_proj.g_idx"], 99)
    _expect("gate_proj.g_idx", ck)


def test_gate_and_up_act_order_must_agree() -> None:
    ck = _gptq_checkpoint(act=True)
    ck["1.up_proj.g_idx"] = ck["1.up_proj.g_idx"].flip(0)
    _expect("up_proj.g_idx", ck, SourceQuantization(4, 32, False, desc_act=True))


def test_stacked_unknown_name_and_bad_shape() -> None:
    layer = random_layer(
        2, 128, 64, bits=4, group_size=32, symmetric=False, generator=torch.Generator()
    )
    stacked = write_stacked(LAYOUTS["awq"], layer, ASYM)
    with pytest.raises(FormatError) as caught:
        read_stacked_layer("awq", {**stacked, "w13_g_idx": torch.zeros(2, 128)}, ASYM)
    assert caught.value.field == "w13_g_idx"
    stacked["w2_qzeros"] = stacked["w2_qzeros"][:1]
    with pytest.raises(FormatError) as caught:
        read_stacked_layer("awq", stacked, ASYM)
    assert caught.value.field == "w2_qzeros"


def test_unknown_layout() -> None:
    with pytest.raises(FormatError) as caught:
        read_layer("exl2", {}, ASYM, num_experts=1)
    assert caught.value.field == "layout"


def test_packers_refuse_what_the_layout_cannot_hold() -> None:
    layer = random_layer(
        1,
        128,
        64,
        bits=4,
        group_size=32,
        symmetric=False,
        generator=torch.Generator(),
        act_order=True,
    )
    with pytest.raises(FormatError) as caught:
        pack_awq(layer.w2)
    assert caught.value.field == "g_idx"
    zero = QuantizedExperts(
        codes=torch.zeros(1, 8, 8, dtype=torch.uint8),
        scales=torch.ones(1, 8, 1),
        bits=4,
        group_size=-1,
        zeros=torch.zeros(1, 8, 1, dtype=torch.uint8),
    )
    with pytest.raises(FormatError) as caught:
        pack_gptq(zero)
    assert caught.value.field == "qzeros"
