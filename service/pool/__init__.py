"""The server side of the process boundary: the worker processes the server supervises.

One worker process per device (`handle`), started, pinged and restarted with a back-off
(`spawn`, `restart`), their answers read in the event loop (`reader`, `calls`); the pool of
them places work and remembers where each kept layer lives (`pool`, `layers`); the segment
files lent to calls (`segments`); which devices get a worker (`devices`). It speaks to the
workers only through `service.ipc` and never imports the worker process's own modules, so
the server never imports torch.
"""
