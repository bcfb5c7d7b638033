"""Checkpoint layouts and kernel layouts of WNA16 MoE expert weights, and their conversion.

At the top, the layouts: every reader (`readers/`) produces the layout-neutral
`QuantizedMoELayer` (`canonical`), every writer (`writers/`) takes one, `registry` is the one
table of layouts (a writer per layout name) and `errors` holds every error of the layer.
Below them: `routes/` (one layer's conversion: the canonical route, the direct packed ->
packed routes, their GPU kernels), `checkpoint/` (the whole-checkpoint job), `io/`
(safetensors files, chunked streams, confined paths, tensor names) and `synthetic/` (our
own quantizer and synthetic checkpoints, for tests, benchmarks and demos).

Nothing here imports the kernels, the worker, the API or grpc.
"""
