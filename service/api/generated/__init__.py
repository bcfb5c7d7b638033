"""Code generated from protos/ by `make protos` (service/api/codegen.py); do not edit."""
