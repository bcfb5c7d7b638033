"""The worker side: one process per device, supervised by the server.

In this release a worker reports its platform profile (device kind, capability, kernel
packages, env flags) and answers pings; later releases give it converted layers and kernels.
The server talks to it over a JSON-lines pipe protocol (`protocol.py`): nothing is ever
unpickled.
"""
