"""What runs around every RPC handler: one interceptor per concern, composed once per method.

- `metrics`: the standard gRPC server metrics (calls started and handled, by code; handling
  time; streamed messages). Outermost, so it counts every call however it ends; not
  installed where another process counts the calls (the primary's private endpoint).
- `auth`: the bearer token. Installed only when a token is configured; health is exempt so
  probes and load balancers need no credentials.
- `status`: a domain error -> its gRPC status, through the table in `service.api.errors`.
- `limits`: per-method concurrency limits, installed on the methods that have one.

`chain` composes them, in that order, around each handler when it is registered
(`registrar`), rather than as `grpc.aio.ServerInterceptor` objects: grpc then runs nothing
per call but the composed handler. `errors` holds the errors these concerns raise.
"""
