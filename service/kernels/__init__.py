"""Runnable MoE experts: one interface (`interface.py`), several backends.

EMULATION (`emulation.py`) is the float32 reference that runs anywhere; TRITON
(`triton/`) is our own fused WNA16 kernel; the humming and Marlin adapters wrap
external kernels. Routing (`routing.py`) and block alignment (`align.py`) are shared.
"""
