"""The server processes of `moe-control serve`: their wiring and life cycle.

`primary` is the process started by hand: it owns the workers, /metrics and the life cycle.
`replica` runs the extra server processes of `--server-processes` and the primary's side of
them (the private endpoint they forward to, the state they are sent); `forward` passes their
calls to the primary as bytes; `readiness` keeps health, the worker metrics and the
replicas up with the workers. The public server every process runs is the API's front.
"""
