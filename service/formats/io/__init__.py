"""Getting tensors in and out: safetensors files, chunked streams, confined paths, names.

Torch-free where the server process uses it (streams, paths, names, safetensors headers):
the server checks and assembles what arrives without ever importing torch.
"""
