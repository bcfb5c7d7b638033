"""The gRPC edge: generated stubs, pb <-> domain codecs, the servicer, interceptors, client.

Importing this package imports no grpc; its modules do.
"""
