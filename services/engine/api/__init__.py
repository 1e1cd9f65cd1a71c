"""The engine's gRPC face: servicers (protobuf in and out) and request validation."""
