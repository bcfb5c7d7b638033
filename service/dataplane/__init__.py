"""The data plane: moe-control's use cases in domain types, with no transport inside.

Selection (static and measured), inline and whole-checkpoint conversion (spread over the
workers when there are several) and RunMoE take requests and give answers as plain Python
objects (dataclasses, the oracle's and formats' own types) and raise domain errors. The gRPC
edge (`service.api`) converts protobuf to these types and back; anything else that wants
the same behaviour (another transport, a test) calls these modules directly. Nothing here
imports grpc, protobuf or the generated code.
"""
