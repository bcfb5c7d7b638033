"""The gRPC service's name and its methods' full names, read from the generated descriptor.

One place for the fact that every door, interceptor, probe and client needs: the name is
the protobuf package's, so a rename in the .proto changes it here and nowhere else.
"""

from __future__ import annotations

from service.api.generated.moe_control.v1 import moe_control_service_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MoeControlService"].full_name


def method_path(method: str) -> str:
    """The full gRPC method name of `method` ("SelectBackend" ->
    "/moe_control.v1.MoeControlService/SelectBackend"), as interceptors and channels see it."""
    return f"/{SERVICE_NAME}/{method}"
