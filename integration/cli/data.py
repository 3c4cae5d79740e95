"""`dgr2 retrieve` and `dgr2 data ...`: the candidates and the re-ranking data built from them."""
from __future__ import annotations

import json
from pathlib import Path

from reranker.data.teachers.traces import RULE_LABEL_STYLES

from ..config import load_config, retrieval_settings, section
from .common import data_paths, json_arg, save_results


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


def cmd_retrieve(args) -> int:
    from candidate_gen.retrieve import run_retrieval

    cfg = load_config(args.config)
    res = run_retrieval(retrieval_settings(cfg, args.data, args.out))
    print(format_retrieval(res))
    return save_results(args.results, res)


def cmd_data_build(args) -> int:
    from reranker.data.dataset import build_rerank_data

    override = json_arg(args.config_json, "--config-json") if args.config_json else {}
    cfg = load_config(args.config)
    retrieval_dir, items, out = data_paths(cfg, args.data)
    opts = {k: v for k, v in section(cfg, "rerank_data").items() if k != "items_path"}
    opts.update(override)
    report = build_rerank_data(retrieval_dir, items, Path(args.out) if args.out else out,
                               seed=int(cfg.get("seed", 0)), **opts)
    print(json.dumps(report, indent=2, default=str))
    return 0


def cmd_data_retrace(args) -> int:
    from reranker.data.retrace import retrace_data

    out = retrace_data(args.data, args.out, style=args.style)
    print(f"{out['style']} traces written to {out['out']}: " + ", ".join(f"{k} {v}" for k, v in out["examples"].items()))
    return 0


def cmd_data_copy_warmup(args) -> int:
    from reranker.data.copy_warmup import build_copy_warmup

    out = build_copy_warmup(args.data, args.out_name, seed=args.seed, limit=args.limit, source=args.source,
                            full_prompt=args.full_prompt, random_sids=args.random_sids, out_path=args.out,
                            straight=args.straight, lookup=args.lookup, trace_style=args.trace_style,
                            relabel_last_code=args.relabel_last_code, uniform_pick=args.uniform_pick)
    print(f"copy warm-up examples written to {out}")
    return 0


def add_retrieve(sub) -> None:
    r = sub.add_parser("retrieve", help="train SASRec, build the FAISS index and candidate lists")
    r.add_argument("--config", required=True)
    r.add_argument("--data", help="directory with <name>.inter / <name>.item (overrides the config)")
    r.add_argument("--out", help="artifacts directory (overrides the config)")
    r.add_argument("--results", help="also write the metrics to this docs/results JSON file")
    r.set_defaults(func=cmd_retrieve)


def add_data(sub) -> None:
    da = sub.add_parser("data", help="re-ranking data")
    dsub = da.add_subparsers(dest="data_command", required=True)
    db = dsub.add_parser("build", help="semantic IDs, tokenizer, teacher traces, train/valid/test examples")
    db.add_argument("--config", required=True)
    db.add_argument("--data", help="atomic data directory (overrides the config)")
    db.add_argument("--out", help="output directory (default <out>/rerank_data)")
    db.add_argument("--config-json", help="rerank_data settings as JSON (override the YAML), e.g. "
                    "'{\"trace_style\": \"brief\", \"tokenizer_from\": \"DIR\"}'")
    db.set_defaults(func=cmd_data_build)
    dr = dsub.add_parser("retrace", help="a copy of a built data dir with its traces rewritten in another style")
    dr.add_argument("--data", required=True, help="re-ranking data directory (dgr2 data build)")
    dr.add_argument("--out", required=True, help="new data directory (SIDs, tokenizer and scorer are copied)")
    dr.add_argument("--style", default="brief", choices=("brief",) + RULE_LABEL_STYLES,
                    help="brief: the decision sentence alone, same rankings; scan: a co-purchase scan "
                    "then the decision, rankings replaced by the scan's pick first; scan_recent: the same over "
                    "the counts after the last 3 items; scan_brand: scan_recent with "
                    "same-brand history counts breaking ties; '_top3': the scan orders its best 3 (see "
                    "reranker/data/teachers/traces.py brief_trace, scan_trace, top_scan)")
    dr.set_defaults(func=cmd_data_retrace)
    dc = dsub.add_parser("copy-warmup", help="copy warm-up examples (copy_warmup.jsonl) from a built data dir")
    dc.add_argument("--data", required=True, help="re-ranking data directory (dgr2 data build)")
    dc.add_argument("--seed", type=int, default=0)
    dc.add_argument("--limit", type=int, default=None, help="first N lists only")
    dc.add_argument("--source", default="train.jsonl", help="lists to build from (valid.jsonl: held-out examples)")
    dc.add_argument("--out-name", default="copy_warmup.jsonl", help="file name written in the data dir")
    dc.add_argument("--out", help="write to this path instead (e.g. a held-out probe file outside the data dir)")
    dc.add_argument("--straight", type=int, metavar="N",
                    help="instead: N lists of random SIDs copied verbatim (the plainest copy task, to start from)")
    dc.add_argument("--lookup", type=int, metavar="N",
                    help="instead: N numbered lists of random SIDs looked up by number ('#6.<sid>', a scan "
                    "decision's step)")
    dc.add_argument("--full-prompt", action="store_true",
                    help="keep each list's real prompt (history, evidence) instead of a short list of SIDs")
    dc.add_argument("--random-sids", action="store_true",
                    help="relabel every SID at random: the model must copy, it cannot recall the catalogue")
    dc.add_argument("--relabel-last-code", action="store_true",
                    help="with --random-sids: draw the dedup (last) code too, so rare dedup tokens get copied")
    dc.add_argument("--trace-style", choices=RULE_LABEL_STYLES,
                    help="answer each real prompt with this rule-scan trace and pick (as retrace does) "
                    "instead of the 'put #k first' copy task")
    dc.add_argument("--uniform-pick", action="store_true",
                    help="with --trace-style: reorder each list's candidates so the scan's pick lands at "
                    "a uniformly drawn position (real lists pick #1 about half the time)")
    dc.set_defaults(func=cmd_data_copy_warmup)
