"""The gRPC re-ranking service (proto in proto/diffusion_gr2/v1/reranker.proto).

server.py: `serve` / `start_server` / `BackgroundServer`; batcher.py: micro-batching with a bounded
queue; validation.py: INVALID_ARGUMENT rules and response building; retrieval.py: Recommend's
SASRec + FAISS stage; client.py: `RerankerClient` and `client_main`; loadtest.py: `loadtest`.
Imports are lazy so `import reranker.service` stays cheap.
"""
__all__ = ["serve", "client_main", "loadtest", "RerankerClient"]


def __getattr__(name):
    if name == "serve":
        from .server import serve
        return serve
    if name == "client_main":
        from .client import client_main
        return client_main
    if name == "RerankerClient":
        from .client import RerankerClient
        return RerankerClient
    if name == "loadtest":
        from .loadtest import loadtest
        return loadtest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
