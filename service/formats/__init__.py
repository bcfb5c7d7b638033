"""Checkpoint readers and kernel-format writers for WNA16 MoE expert weights.

Every reader produces the layout-neutral `QuantizedMoELayer` (`canonical.py`); every writer
takes one. A conversion is therefore reader -> canonical -> writer, and the canonical form is
also what the round-trip tests dequantize.
"""
