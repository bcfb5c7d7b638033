"""Our own Triton WNA16 MoE kernels and the TRITON experts backend that runs them.

`config` (tile types, heuristics, when decode is taken), `tuned` (the measured tables in
`configs/`), `jit` (device functions both kernel families share), `prefill` (aligned
tensor-core GEMMs), `decode` (per-route split-K GEMVs), `experts` (the backend).
"""
