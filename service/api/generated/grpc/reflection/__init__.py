"""Generated from protos/grpc/reflection/."""
