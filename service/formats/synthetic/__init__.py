"""Synthetic quantized MoE weights and checkpoints, for tests, benchmarks and demos.

`quantize` is our own min-max quantizer; `checkpoints` lays its output out as a Hugging Face
model directory. Nothing is ever downloaded.
"""
