"""The HTTP/JSON front door: the same data plane as gRPC, for curl, CI gates, dashboards
and clients without our stubs (docs/http.md).

Built on Starlette served by uvicorn. Why these: Starlette is a small, typed ASGI toolkit
(routing, requests, responses, a test client on httpx) with nothing we would not use, and
uvicorn is the ASGI server it is made for (with httptools, its C HTTP/1.1 parser), running
on the asyncio event loop the primary server process already runs, so this door shares the
process's data plane, pool and limits instead of starting its own; the issue asked for
starlette or FastAPI on uvicorn, and FastAPI's value (request models, generated OpenAPI
from them) would declare the JSON a second time beside the oracle's own parsing, which
already names every bad field.

One module per job: `app` (the route table and the wiring), `handlers` (each route's call
into the data plane), `codecs` (request JSON in, answer JSON out: the CLI's `--json`
shapes), `errors` (one JSON error shape from `google.rpc.Status`, HTTP status from the
gRPC-HTTP mapping), `auth` (the bearer token), `limits` (body size, per-method
concurrency), `observe` (metrics), `schemas` (every JSON Schema, declared once),
`openapi` (the document, from the route table and the schemas), `serve` (uvicorn in the
running loop, TLS).
"""
