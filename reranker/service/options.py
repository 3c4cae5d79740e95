"""The service's settings and the `serve` command-line options.

Plain dataclasses and argparse only (no gRPC, no model library), so `dgr2 --help` can build the
serve parser without importing what serving needs.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

DECODERS = ("ar", "diffusion")


@dataclass
class ServiceLimits:
    """What the server accepts. Every field is a server option (see server.py --help)."""
    max_candidates: int = 100
    max_history: int = 50  # H: longer histories keep the most recent H items (reported, not rejected)
    max_message_bytes: int = 1 << 20  # checked in the handler (INVALID_ARGUMENT); gRPC's own cap is 4x
    max_item_id_chars: int = 256
    max_new_tokens: int = 320  # default generation budget and the most a request may ask for
    default_decoder: str = "ar"
    default_tau: float = 0.9
    recommend_candidates: int = 10  # Recommend's default number of retrieved candidates

    def __post_init__(self):
        for name in ("max_candidates", "max_history", "max_message_bytes", "max_item_id_chars",
                     "max_new_tokens", "recommend_candidates"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ServiceLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.default_decoder not in DECODERS:
            raise ValueError(f"ServiceLimits.default_decoder must be 'ar' or 'diffusion', got {self.default_decoder!r}")
        if not 0.0 < self.default_tau <= 1.0:
            raise ValueError(f"ServiceLimits.default_tau must be in (0, 1], got {self.default_tau}")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see RunningServer.port)
    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    drain_grace_s: float = 30.0
    warmup: bool = True
    limits: ServiceLimits = field(default_factory=ServiceLimits)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve options (shared with `dgr2 serve`)."""
    d, lim = ServerConfig(), ServiceLimits()
    p.add_argument("--model", required=True, help="model directory (HF causal LM + tokenizer)")
    p.add_argument("--data", required=True, help="re-ranking data directory (dgr2 data build)")
    p.add_argument("--retrieval", help="retrieval artifacts directory; enables Recommend")
    p.add_argument("--host", default=d.host, help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=d.port, help="0: any free port")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="requests per batched decode")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms, help="how long a batch waits to fill")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="queued requests before RESOURCE_EXHAUSTED")
    p.add_argument("--tls-cert", help="PEM certificate (with --tls-key): serve TLS")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s)
    p.add_argument("--max-candidates", type=int, default=lim.max_candidates)
    p.add_argument("--max-history", type=int, default=lim.max_history, help="longer histories keep the newest")
    p.add_argument("--max-message-bytes", type=int, default=lim.max_message_bytes)
    p.add_argument("--max-new-tokens", type=int, default=lim.max_new_tokens)
    p.add_argument("--decoder", choices=DECODERS, default=lim.default_decoder, help="default decoder")
    p.add_argument("--tau", type=float, default=lim.default_tau, help="default diffusion commit threshold")
    p.add_argument("--recommend-candidates", type=int, default=lim.recommend_candidates)
