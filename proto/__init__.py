"""Protocol buffers for the gRPC service (sources and generated stubs)."""
