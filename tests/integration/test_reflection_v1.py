"""A client that speaks only `grpc.reflection.v1` lists the services and reads their
descriptors (as grpcurl, buf curl and grpc-js's reflection clients do today)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health

from integration.serverproc import SERVICE, ServerProcess
from service.api.generated.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from service.api.generated.grpc.reflection.v1 import reflection_pb2_grpc as v1_pb2_grpc
from service.server.reflection import REFLECTION_SERVICES, V1_SERVICE_NAME


def ask(
    server: ServerProcess, *requests: v1_pb2.ServerReflectionRequest
) -> list[v1_pb2.ServerReflectionResponse]:
    with server.channel() as channel:
        stub = v1_pb2_grpc.ServerReflectionStub(channel)
        return list(stub.ServerReflectionInfo(iter(requests), timeout=5))


def test_a_v1_client_lists_the_services(server: ServerProcess) -> None:
    (answer,) = ask(server, v1_pb2.ServerReflectionRequest(list_services=""))
    names = {service.name for service in answer.list_services_response.service}
    assert names == {SERVICE, health.SERVICE_NAME, *REFLECTION_SERVICES}
    assert V1_SERVICE_NAME == "grpc.reflection.v1.ServerReflection"


def test_a_v1_client_reads_the_services_descriptor(server: ServerProcess) -> None:
    answers = ask(
        server,
        v1_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        v1_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol"),
    )
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in answers[0].file_descriptor_response.file_descriptor_proto
    ]
    owner = next(f for f in files if f.name == "moe_control/v1/moe_control_service.proto")
    methods = {m.name for s in owner.service for m in s.method}
    assert {"SelectBackend", "ConvertWeights", "RunMoE"} <= methods
    assert answers[0].original_request.file_containing_symbol == SERVICE
    assert answers[1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
