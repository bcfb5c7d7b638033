"""Generated from protos/grpc/."""
