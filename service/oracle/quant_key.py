"""vLLM's `QuantKey` for WNA16 weights, as plain values, with vLLM's own text rendering.

vLLM compares quant keys by value and prints them into its reason strings
("kernel does not support quantization scheme QuantKey(uint4b8,scale(f16,static,per_token),
symmetric)xNone"), so the oracle needs both the value and the exact text.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.oracle.decision import WeightKey

#: vLLM's named group shapes and how its `ScaleDesc.__str__` prints them.
PER_TOKEN = (1, -1)
PER_CHANNEL = (-1, 1)
PER_TENSOR = (-1, -1)
_NAMED_GROUP_SHAPES = {PER_TENSOR: "per_tensor", PER_TOKEN: "per_token", PER_CHANNEL: "per_channel"}

#: Symmetric scalar types by bit width (value = stored - bias) and asymmetric ones.
SYMMETRIC_TYPES = {
    2: "uint2b2",
    3: "uint3b4",
    4: "uint4b8",
    5: "uint5b16",
    6: "uint6b32",
    7: "uint7b64",
    8: "uint8b128",
}
ASYMMETRIC_TYPES = {bits: f"uint{bits}" for bits in range(2, 9)}


@dataclass(frozen=True, slots=True)
class QuantKey:
    """A weight quant key: scalar type, fp16 static scale with a group shape, symmetry."""

    dtype: str
    group_shape: tuple[int, int] = PER_TOKEN
    symmetric: bool = True
    scale_dtype: str = "float16"

    @property
    def bits(self) -> int:
        digits = self.dtype.removeprefix("uint").split("b")[0]
        return int(digits)

    @property
    def is_unsigned_int(self) -> bool:
        return self.dtype.startswith("uint")

    def render(self) -> str:
        """The text vLLM's `QuantKey.__str__` gives."""
        rows, cols = self.group_shape
        shape = _NAMED_GROUP_SHAPES.get(self.group_shape, f"GroupShape(row={rows}, col={cols})")
        abbr = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[self.scale_dtype]
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"QuantKey({self.dtype},scale({abbr},static,{shape}),{sym})"

    def to_weight_key(self) -> WeightKey:
        return WeightKey(self.dtype, self.scale_dtype, self.group_shape, self.symmetric)


K_INT4_STATIC = QuantKey("uint4b8")
K_INT4_STATIC_32 = QuantKey("uint4b8", (1, 32))
K_INT8_STATIC = QuantKey("uint8b128")
K_INT4_STATIC_ASYM = QuantKey("uint4", symmetric=False)
K_INT4_STATIC_32_ASYM = QuantKey("uint4", (1, 32), symmetric=False)
