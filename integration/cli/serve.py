"""`dgr2 serve`, `dgr2 client` and `dgr2 loadtest`: the gRPC service and the tools that call it."""
from __future__ import annotations

import argparse

# Subcommands with their own argument parsers: everything after the name is theirs (argparse's
# REMAINDER would refuse a leading option such as -h).
PASS_THROUGH = {"client": ("reranker.service.client", "client_main"), "loadtest": ("reranker.service.loadtest", "main")}


def cmd_serve(args) -> int:
    from reranker.service.server import serve_from_args

    return serve_from_args(args)


def add_serve(sub) -> None:
    from reranker.service.options import add_serve_arguments

    sv = sub.add_parser("serve", help="serve Rerank / Recommend over gRPC")
    add_serve_arguments(sv)
    sv.set_defaults(func=cmd_serve)


def add_client(sub) -> None:
    cl = sub.add_parser("client", help="call a running server: rerank | recommend | health", add_help=False)
    cl.add_argument("rest", nargs=argparse.REMAINDER)
    cl.set_defaults(func=lambda a: __import__("reranker.service.client", fromlist=["client_main"]).client_main(a.rest))


def add_loadtest(sub) -> None:
    lt = sub.add_parser("loadtest", help="load-test a running server on loopback", add_help=False)
    lt.add_argument("rest", nargs=argparse.REMAINDER)
    lt.set_defaults(func=lambda a: __import__("reranker.service.loadtest", fromlist=["main"]).main(a.rest))
