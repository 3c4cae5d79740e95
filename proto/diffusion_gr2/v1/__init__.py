"""diffusion_gr2.v1: the re-ranking service's messages (reranker_pb2) and gRPC stubs (reranker_pb2_grpc)."""
