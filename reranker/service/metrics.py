"""Prometheus metrics of one server (`dgr2 serve --metrics-port PORT`: http://HOST:PORT/metrics).

Each server has its own CollectorRegistry, so two servers in one process (tests, a notebook) never
share or double-register a metric. The metrics:

    dgr2_requests_total{method, code}         RPCs answered, by gRPC status code (OK, INVALID_ARGUMENT, ...)
    dgr2_request_latency_seconds{method}      handler latency, every status
    dgr2_queue_depth                          requests admitted and not yet answered (being prepared,
                                              waiting or decoding): at most --max-queue
    dgr2_batch_size{decoder}                  requests per batched decode
    dgr2_rerank_results_total{decoder}        requests a decode answered
    dgr2_fallbacks_total{decoder}             of those, answered in the listed order; the fallback
                                              rate is rate(fallbacks) / rate(rerank_results)
    dgr2_tokens_per_forward{decoder}          per batch: generated tokens per row / forward passes
                                              (AR: 1; block diffusion: the tokens a step commits)
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKENS_PER_FORWARD_BUCKETS = (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class ServiceMetrics:
    def __init__(self, queue_depth: Callable[[], float]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dgr2_requests", "RPCs answered, by method and gRPC status code",
                                ["method", "code"], registry=r)
        self.latency = Histogram("dgr2_request_latency_seconds", "handler latency, by method (every status)",
                                 ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("dgr2_queue_depth", "requests admitted and not yet answered (at most --max-queue)",
                                 registry=r)
        self.queue_depth.set_function(queue_depth)  # read at scrape time: no bookkeeping to drift
        self.batch_size = Histogram("dgr2_batch_size", "requests per batched decode", ["decoder"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.results = Counter("dgr2_rerank_results", "requests a decode answered", ["decoder"], registry=r)
        self.fallbacks = Counter("dgr2_fallbacks", "requests answered in the order their prompt listed (the "
                                 "model's answer was not a valid permutation, or the decode failed)", ["decoder"],
                                 registry=r)
        self.tokens_per_forward = Histogram("dgr2_tokens_per_forward", "per batch: generated tokens per row / "
                                            "forward passes", ["decoder"], buckets=TOKENS_PER_FORWARD_BUCKETS,
                                            registry=r)
        self._http = None

    def observe_request(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)

    def observe_batch(self, decoder: str, results: list) -> None:
        """One batched decode's results (RerankResult, or an exception for a request it could not take)."""
        answered = [r for r in results if hasattr(r, "fallback")]
        self.batch_size.labels(decoder).observe(len(results))
        if not answered:
            return
        self.results.labels(decoder).inc(len(answered))
        self.fallbacks.labels(decoder).inc(sum(bool(r.fallback) for r in answered))
        forwards = max(r.forward_passes for r in answered)
        if forwards > 0:
            row_tokens = sum(r.generated_tokens for r in answered) / len(answered)
            self.tokens_per_forward.labels(decoder).observe(row_tokens / forwards)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics over HTTP on a daemon thread (prometheus_client's own server)."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)

    @property
    def port(self) -> int | None:
        return self._http.server_address[1] if self._http is not None else None

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
