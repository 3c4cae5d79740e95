"""`dgr2`: the command-line entry point. One sub-command per job; each maps to one function."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .config import ConfigError, load_config, section


def _retrieval_settings(cfg: dict, data: str | None, out: str | None):
    from candidate_gen.retrieve import RetrievalSettings

    d = section(cfg, "data")
    r = section(cfg, "retrieval")
    data_dir = data or d.get("dir")
    return RetrievalSettings(
        out=Path(out or r.get("out") or Path(cfg["out"]) / "retrieval"),
        data_dir=Path(data_dir) if data_dir else None,
        synthetic=d.get("synthetic") or {},
        user_k=int(d.get("user_k", 5)),
        item_k=int(d.get("item_k", 5)),
        seed=int(cfg.get("seed", 0)),
        n_candidates=int(r.get("n_candidates", 10)),
        crossfit_folds=int(r.get("crossfit_folds", 2)),
        index=r.get("index", "flat"),
        sasrec=r.get("sasrec") or {},
        fold_sasrec=r.get("fold_sasrec") or {},
        agreement_users=int(r.get("agreement_users", 0)),
    )


def cmd_retrieve(args) -> int:
    from candidate_gen.retrieve import run_retrieval

    cfg = load_config(args.config)
    res = run_retrieval(_retrieval_settings(cfg, args.data, args.out))
    print(format_retrieval(res))
    return 0


def format_retrieval(res: dict) -> str:
    keys = ["recall@10", "ndcg@10", "recall@10_masked", "ndcg@10_masked", "recall@50_masked",
            "faiss_recbole_top10_agreement", "hnsw_recall@10", "test_users_target_in_top10",
            "train_hit_rate_in_sample", "train_hit_rate_crossfit", "train_seconds", "wall_seconds"]
    lines = [f"retrieval on {res['dataset']}: {res['users']} users, {res['items']} items, "
             f"{res['interactions']} interactions", f"{'metric':34s} value"]
    for k in keys:
        v = res.get(k)
        lines.append(f"{k:34s} {v:.4f}" if isinstance(v, float) else f"{k:34s} {v}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgr2", description="Diffusion-GR2 re-ranking plugin")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("retrieve", help="train SASRec, build the FAISS index and candidate lists")
    r.add_argument("--config", required=True)
    r.add_argument("--data", help="directory with <name>.inter / <name>.item (overrides the config)")
    r.add_argument("--out", help="artifacts directory (overrides the config)")
    r.set_defaults(func=cmd_retrieve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"dgr2 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
