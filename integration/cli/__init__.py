"""`dgr2`: the command-line entry point. One sub-command per job; each maps to one function.

One module per command group, in the data flow's order: data (`retrieve`, `data ...`), train (`model
...`, `train`, `convert`), evaluate (`eval`, `speed`, `baselines`, `e2e`), serve (`serve`, `client`,
`loadtest`), pipeline (`pipeline`, `demo`, `release`) and research (diagnostics, cost
microbenchmarks, results and benchmark builders); common holds what they share. Building the parser imports none of the
heavy libraries: each command imports what it needs when it runs.
"""
from __future__ import annotations

import argparse
import logging
import sys

from reranker.stages.base import NotDoneError

from ..config import ConfigError
from . import data, evaluate, pipeline, research, serve, train
from .allocator import keep_freed_memory
from .serve import PASS_THROUGH

# Each group's parser builders (add_<command>), and the order `dgr2 --help` lists the commands in.
_GROUPS = {data: ["retrieve", "data"], train: ["model", "train", "convert"],
           evaluate: ["eval", "speed", "baselines", "e2e"], serve: ["serve", "client", "loadtest"],
           pipeline: ["pipeline", "demo", "release"],
           research: ["sid-copy", "forward-cost", "train-cost", "report", "results", "bench"]}
_ADDERS = {name: getattr(group, "add_" + name.replace("-", "_")) for group, names in _GROUPS.items() for name in names}
_ORDER = ["retrieve", "results", "bench", "sid-copy", "report", "speed", "forward-cost", "train-cost", "eval",
          "convert", "data", "baselines", "e2e", "model", "train", "serve", "client", "loadtest", "pipeline", "demo",
          "release"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgr2", description="Diffusion-GR2 re-ranking plugin")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    for name in _ORDER:
        _ADDERS[name](sub)
    return p


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # the `dgr2` executable, not a caller inside another process
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASS_THROUGH:
        module, func = PASS_THROUGH[argv[0]]
        return getattr(__import__(module, fromlist=[func]), func)(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    if as_program:  # a process-wide setting: only for a process that is dgr2 (allocator.py says why)
        keep_freed_memory()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, NotDoneError) as e:
        print(f"dgr2 {args.command}: error: {e}", file=sys.stderr)
        return 2

