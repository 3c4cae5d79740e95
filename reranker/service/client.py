"""A synchronous Python client for the re-ranking service, and `dgr2 client rerank|recommend|health`.

    with RerankerClient("127.0.0.1:50051") as c:
        resp = c.rerank(["i1", "i2", "i3"], history=["i9"], scores=[0.9, 0.5, 0.1], return_reasoning=True)
        print([(it.item_id, it.previous_rank, it.new_rank) for it in resp.items], resp.fallback)

Errors surface as grpc.RpcError (code() and details() tell what was wrong; INVALID_ARGUMENT details
start with the field name).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.diffusion_gr2.v1 import reranker_pb2 as pb
from proto.diffusion_gr2.v1 import reranker_pb2_grpc as pb_grpc

from ..decoding import add_decode_flags

# setting name -> proto enum (reranker.decoding owns the names; None leaves the field unset); the
# request validation reads it backwards
ENUM_SETTINGS = {
    "decoder": {None: pb.DECODER_UNSPECIFIED, "ar": pb.DECODER_AR, "ar_lookup": pb.DECODER_AR_LOOKUP,
                "diffusion": pb.DECODER_DIFFUSION},
    "commit_rule": {None: pb.COMMIT_RULE_UNSPECIFIED, "confidence": pb.COMMIT_RULE_CONFIDENCE,
                    "prefix": pb.COMMIT_RULE_PREFIX},
    "compute_dtype": {None: pb.COMPUTE_DTYPE_UNSPECIFIED, "float32": pb.COMPUTE_DTYPE_FLOAT32,
                      "bfloat16": pb.COMPUTE_DTYPE_BFLOAT16},
}
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20  # the client lets the server decide what is too large


def decode_options(decoder: str | None = None, tau: float | None = None, block_size: int | None = None,
                   return_reasoning: bool = False, top_k: int = 0, max_new_tokens: int | None = None,
                   commit_rule: str | None = None, hold_eos: bool | None = None, window: int | None = None,
                   reuse_settled: bool | None = None, lookup_drafts: bool | None = None,
                   compute_dtype: str | None = None) -> pb.DecodeOptions:
    """proto DecodeOptions; None leaves a field unset (the server's default: its flags, else the
    model's recorded setting). The server validates the values."""
    enums = {}
    for name, value in (("decoder", decoder), ("commit_rule", commit_rule), ("compute_dtype", compute_dtype)):
        table = ENUM_SETTINGS[name]
        if value not in table:
            raise ValueError(f"{name} must be one of {[k for k in table if k]} or None, got {value!r}")
        enums[name] = table[value]
    opts = pb.DecodeOptions(**enums, return_reasoning=return_reasoning, top_k=top_k)
    for name, value in (("tau", tau), ("block_size", block_size), ("max_new_tokens", max_new_tokens),
                        ("hold_eos", hold_eos), ("window", window), ("reuse_settled", reuse_settled),
                        ("lookup_drafts", lookup_drafts)):
        if value is not None:
            setattr(opts, name, value)
    return opts


def rerank_request(candidates: Sequence[str], history: Sequence[str] = (), scores: Sequence[float] | None = None,
                   user_id: str = "", options: pb.DecodeOptions | None = None) -> pb.RerankRequest:
    if scores is not None and len(scores) != len(candidates):
        raise ValueError(f"{len(scores)} scores for {len(candidates)} candidates")
    scores = scores if scores is not None else [0.0] * len(candidates)
    return pb.RerankRequest(user_id=user_id, history=list(history), options=options,
                            candidates=[pb.Candidate(item_id=c, score=s) for c, s in zip(candidates, scores)])


def channel(target: str, tls_ca: str | Path | None = None, server_name: str | None = None,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, aio: bool = False):
    """A (sync or asyncio) channel: plaintext, or TLS trusting the PEM `tls_ca`."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if server_name:  # the certificate's name when the target is an address
        options.append(("grpc.ssl_target_name_override", server_name))
    mod = grpc.aio if aio else grpc
    if tls_ca is None:
        return mod.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
    return mod.secure_channel(target, creds, options=options)


class RerankerClient:
    def __init__(self, target: str = "127.0.0.1:50051", tls_ca: str | Path | None = None,
                 server_name: str | None = None, timeout: float | None = 30.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.target = target
        self.timeout = timeout
        self.channel = channel(target, tls_ca, server_name, max_message_bytes)
        self.stub = pb_grpc.RerankerStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def rerank(self, candidates: Sequence[str], history: Sequence[str] = (), scores: Sequence[float] | None = None,
               user_id: str = "", decoder: str | None = None, tau: float | None = None,
               block_size: int | None = None, return_reasoning: bool = False, top_k: int = 0,
               max_new_tokens: int | None = None, timeout: float | None = None, commit_rule: str | None = None,
               hold_eos: bool | None = None, window: int | None = None,
               reuse_settled: bool | None = None, lookup_drafts: bool | None = None,
               compute_dtype: str | None = None) -> pb.RerankResponse:
        opts = decode_options(decoder, tau, block_size, return_reasoning, top_k, max_new_tokens, commit_rule, hold_eos,
                              window, reuse_settled, lookup_drafts, compute_dtype)
        return self.send(rerank_request(candidates, history, scores, user_id, opts), timeout)

    def send(self, request: pb.RerankRequest, timeout: float | None = None) -> pb.RerankResponse:
        """Send a prepared RerankRequest (the raw call)."""
        return self.stub.Rerank(request, timeout=timeout or self.timeout)

    def recommend(self, history: Sequence[str], num_candidates: int = 0, user_id: str = "",
                  decoder: str | None = None, tau: float | None = None, block_size: int | None = None,
                  return_reasoning: bool = False, top_k: int = 0, max_new_tokens: int | None = None,
                  timeout: float | None = None, commit_rule: str | None = None,
                  hold_eos: bool | None = None, window: int | None = None,
                  reuse_settled: bool | None = None, lookup_drafts: bool | None = None,
                  compute_dtype: str | None = None) -> pb.RecommendResponse:
        opts = decode_options(decoder, tau, block_size, return_reasoning, top_k, max_new_tokens, commit_rule, hold_eos,
                              window, reuse_settled, lookup_drafts, compute_dtype)
        req = pb.RecommendRequest(user_id=user_id, history=list(history), num_candidates=num_candidates, options=opts)
        return self.stub.Recommend(req, timeout=timeout or self.timeout)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """"SERVING", "NOT_SERVING", ... for `service` ("" = the whole server)."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_serving(self, timeout: float = 60.0, poll_s: float = 0.05) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self.health(timeout=max(0.1, min(2.0, end - time.monotonic()))) == "SERVING":
                    return True
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(poll_s)
        return False

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RerankerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def to_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _ids(text: str | None) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else []


def _request_file(path: str) -> dict:
    """A JSON object, or the first line of a JSONL file such as candidates/test.jsonl."""
    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[0])


def client_main(argv: Sequence[str] | None = None) -> int:
    """`dgr2 client rerank|recommend|health ...`: one call, the response printed as JSON."""
    p = argparse.ArgumentParser(prog="dgr2 client", description="Call a running re-ranking server.")
    sub = p.add_subparsers(dest="call", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051")
    common.add_argument("--tls-ca", help="PEM certificate to trust (TLS); plaintext without it")
    common.add_argument("--server-name", help="name in the server certificate, when --target is an address")
    common.add_argument("--timeout", type=float, default=30.0, help="deadline in seconds")
    decode = argparse.ArgumentParser(add_help=False)
    decode.add_argument("--history", help="comma-separated item ids, oldest first")
    decode.add_argument("--user", default="")
    names = ("decoder", "tau", "block_size", "commit_rule", "hold_eos", "max_new_tokens", "window", "reuse_settled",
             "lookup_drafts", "compute_dtype")
    add_decode_flags(decode, names, {n: "unset: the server's default" for n in names})
    decode.add_argument("--reasoning", action="store_true", help="return the reasoning trace")
    decode.add_argument("--top-k", type=int, default=0)
    r = sub.add_parser("rerank", parents=[common, decode], help="re-rank given candidates")
    r.add_argument("--candidates", help="comma-separated item ids in retriever order")
    r.add_argument("--scores", help="comma-separated retriever scores")
    r.add_argument("--request", help="JSON (or JSONL, first line) with history, candidates, scores, user")
    m = sub.add_parser("recommend", parents=[common, decode], help="retrieve from the history, then re-rank")
    m.add_argument("--num-candidates", type=int, default=0)
    h = sub.add_parser("health", parents=[common], help="health status")
    h.add_argument("--service", default="")
    args = p.parse_args(argv)

    try:
        with RerankerClient(args.target, args.tls_ca, args.server_name, args.timeout) as c:
            if args.call == "health":
                print(json.dumps({"status": c.health(args.service, timeout=args.timeout)}))
                return 0
            kw = dict(decoder=args.decoder, tau=args.tau, block_size=args.block_size, commit_rule=args.commit_rule,
                      hold_eos=args.hold_eos, return_reasoning=args.reasoning, top_k=args.top_k,
                      max_new_tokens=args.max_new_tokens, window=args.window, reuse_settled=args.reuse_settled,
                      lookup_drafts=args.lookup_drafts, compute_dtype=args.compute_dtype)
            if args.call == "rerank":
                row = _request_file(args.request) if args.request else {}
                candidates = _ids(args.candidates) or row.get("candidates", [])
                scores = [float(s) for s in _ids(args.scores)] or row.get("scores")
                history = _ids(args.history) or row.get("history", [])
                resp = c.rerank(candidates, history, scores, args.user or row.get("user", ""), **kw)
            else:
                resp = c.recommend(_ids(args.history), args.num_candidates, args.user, **kw)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:  # unreadable files, bad numbers, scores/candidates mismatch
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_dict(resp), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(client_main())
