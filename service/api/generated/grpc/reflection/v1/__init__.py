"""Generated from protos/grpc/reflection/v1/ (gRPC server reflection v1; grpcio-reflection ships only v1alpha)."""
