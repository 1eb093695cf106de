"""Generated gRPC stubs (python -m sidecar.protogen); do not edit."""
