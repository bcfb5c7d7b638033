"""The clients the CLI (and the tests and benchmarks) use to call a moe-control server:
synchronous, one module per RPC family (`select`, `convert`, `run`, `health`), on the
`Connection` and `Session` of `channel` (TLS, the token, one deadline per command, waiting
for readiness, retries where the server's RetryInfo asks). They sit above the API and use
its generated messages and codecs; the server's failures come back as `grpc.RpcError`, or as
`errors.RemoteSelectionError` where the CLI prints a decision's failure.
"""
