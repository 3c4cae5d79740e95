"""The service's settings and the `serve` command-line options.

Plain dataclasses and argparse only (no gRPC, no model library), so `dgr2 --help` can build the
serve parser without importing what serving needs.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..decoding import DECODERS, DecodeOptions, add_decode_flags, check_recorded, check_workers

# The decode settings a server may set for requests that send none (the rest are the model's).
SERVER_DECODE_FLAGS = ("decoder", "tau", "commit_rule", "hold_eos", "temperature", "window", "reuse_settled",
                       "lookup_drafts", "compute_dtype")
# `--max-candidates` when unset: the most candidates whose prompt fits the model's context, at most this.
CANDIDATES_CAP = 100


@dataclass
class ServiceLimits:
    """What the server accepts. Every field is a server option (see server.py --help)."""
    max_candidates: int | None = None  # None: derived at start from what fits the model's context
    max_history: int = 50  # H: longer histories keep the most recent H items (reported, not rejected)
    max_message_bytes: int = 1 << 20  # checked in the handler (INVALID_ARGUMENT); gRPC's own cap is 4x
    max_item_id_chars: int = 256
    max_new_tokens: int = 320  # the most a request may ask for (and the cap on the default budget)
    recommend_candidates: int = 10  # Recommend's default number of retrieved candidates (at most max_candidates)
    # decode settings for requests that send none, over the model's recorded ones (SERVER_DECODE_FLAGS)
    decode: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("max_history", "max_message_bytes", "max_item_id_chars", "max_new_tokens",
                     "recommend_candidates") + (("max_candidates",) if self.max_candidates is not None else ()):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ServiceLimits.{name} must be >= 1, got {getattr(self, name)}")
        unknown = sorted(set(self.decode) - set(SERVER_DECODE_FLAGS))
        if unknown:
            raise ValueError(f"ServiceLimits.decode: unknown setting(s) {unknown}; known: {list(SERVER_DECODE_FLAGS)}")
        self.decode = {k: v for k, v in self.decode.items() if v is not None}
        check_recorded(self.decode, "ServiceLimits.decode")  # the same checks as a recorded setting


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see RunningServer.port)
    max_batch: int = 8
    # per decoder, over max_batch: on a CPU a block-diffusion step costs more per row than an AR step
    # (every row runs its whole block), so diffusion may serve more per second in smaller batches
    decoder_max_batch: dict = field(default_factory=dict)
    # decode threads sharing the model and `decode_threads` torch threads: worker 0, which takes
    # every lone batch, gets all of them while it decodes alone (RerankerService._share_threads)
    decode_workers: int = 1
    decode_threads: int = 0  # 0: torch's intra-op thread count when the service starts
    max_wait_ms: float = 5.0
    max_queue: int = 64  # requests admitted at once, the decoding batch included
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    drain_grace_s: float = 30.0
    warmup: bool = True
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0: off
    limits: ServiceLimits = field(default_factory=ServiceLimits)


    def __post_init__(self):
        self.decoder_max_batch = check_decoder_max_batch(self.decoder_max_batch)
        check_workers(self.decode_workers, "decode_workers")
        if self.decode_threads != 0:
            check_workers(self.decode_threads, "decode_threads (0: torch's thread count)")


def check_decoder_max_batch(caps) -> dict:
    """{decoder: batch cap}: known decoders, caps >= 1."""
    out = {}
    for name, cap in dict(caps or {}).items():
        if name not in DECODERS:
            raise ValueError(f"decoder_max_batch: unknown decoder {name!r}; known: {list(DECODERS)}")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"decoder_max_batch[{name!r}] must be an int >= 1, got {cap!r}")
        out[name] = cap
    return out


def parse_decoder_max_batch(spec: str) -> dict:
    """`--decoder-max-batch diffusion=2,ar=8` as {decoder: cap} (argparse type)."""
    out = {}
    for part in (p.strip() for p in (spec or "").split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected DECODER=N[,DECODER=N], got {part!r}")
        out[name.strip()] = int(value)
    try:
        return check_decoder_max_batch(out)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve options (shared with `dgr2 serve`)."""
    d, lim = ServerConfig(), ServiceLimits()
    p.add_argument("--model", required=True, help="model directory (HF causal LM + tokenizer)")
    p.add_argument("--data", help="re-ranking data directory (dgr2 data build) or a release bundle (dgr2 release); "
                                  "default: the bundle the model lies in")
    p.add_argument("--retrieval", help="retrieval artifacts directory; enables Recommend")
    p.add_argument("--host", default=d.host, help="bind address of gRPC and metrics (default: loopback only)")
    p.add_argument("--port", type=int, default=d.port, help="0: any free port")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="requests per batched decode")
    p.add_argument("--decoder-max-batch", type=parse_decoder_max_batch, default={}, metavar="DECODER=N[,...]",
                   help="a decoder's own cap over --max-batch, e.g. diffusion=2")
    p.add_argument("--decode-workers", type=int, default=d.decode_workers,
                   help="batches decoded at once, each on its own thread. Torch's threads (OMP_NUM_THREADS) go to "
                        "worker 0, which takes every lone batch, while it decodes alone; with k batches at once it "
                        "runs on 1/k of them and the others on one (on a 2-core CPU, 2 workers of 1 thread served "
                        "about twice the requests of 1 of 2)")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms, help="how long a batch waits to fill")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests admitted at once, the decoding batch included; one more gets RESOURCE_EXHAUSTED "
                        "at once, before any retrieval or decoding")
    p.add_argument("--tls-cert", help="PEM certificate (with --tls-key): serve TLS")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s,
                   help="on SIGTERM, how long in-flight requests may finish; the process exits within about 1 s "
                        "after it")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics; 0: off")
    p.add_argument("--max-candidates", type=int, default=lim.max_candidates,
                   help=f"default: the most candidates whose prompt fits the model's context beside "
                        f"--max-new-tokens (at most {CANDIDATES_CAP}), found at start")
    p.add_argument("--max-history", type=int, default=lim.max_history, help="longer histories keep the newest")
    p.add_argument("--max-message-bytes", type=int, default=lim.max_message_bytes)
    p.add_argument("--max-new-tokens", type=int, default=lim.max_new_tokens,
                   help="the most a request may ask for; one that asks none gets the model's recorded budget, "
                        "capped by this")
    p.add_argument("--recommend-candidates", type=int, default=lim.recommend_candidates,
                   help="how many a Recommend request that asks none retrieves (at most --max-candidates)")
    builtin = DecodeOptions()
    add_decode_flags(p, SERVER_DECODE_FLAGS,
                     {n: f"{n.replace('_', ' ')} of a request that sets none; unset: the model's recorded one, else "
                         f"{getattr(builtin, n)}" for n in SERVER_DECODE_FLAGS})
