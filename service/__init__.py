"""moe-control: a gRPC control plane for weight-only-quantized Mixture-of-Experts kernels."""

__version__ = "0.1.0"
