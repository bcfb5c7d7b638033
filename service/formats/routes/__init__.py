"""Conversion routes: how one MoE layer's tensors become a backend's tensors.

`convert` picks the route: a direct packed -> packed route (`direct`: `read`, `transforms`,
`targets`, and the fused Triton kernels of `gpu_repack` on a GPU) where one covers the
layer, else the canonical route (`canonical`: reader -> canonical layer -> writer), the
same bytes either way. `spec` decides what a conversion reads and writes before any tensor
moves (torch-free); `inline` converts one layer named any way a client sends it.
"""
