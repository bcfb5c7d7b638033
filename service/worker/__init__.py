"""The worker process: one per device, started and supervised by the server.

A worker reports its platform profile (device kind, capability, kernel packages, env flags),
answers pings, converts layers and checkpoints, keeps converted layers on its device and runs
them (RunMoE), and measures backends for the measured policy. It speaks to the server only
through `service.ipc` (the JSON-lines pipe protocol and the shared-memory segments): nothing
is ever unpickled, and the server side of the boundary (`service.pool`) is never imported
here.
"""
