"""Research tools: diagnostics, cost microbenchmarks and the docs/results / BENCHMARKS.md builders
(`dgr2 sid-copy`, `forward-cost`, `train-cost`, `report`, `results`, `bench`)."""
from __future__ import annotations

import json
from pathlib import Path

from .common import command_line, ints, save_results


def cmd_sid_copy(args) -> int:
    from reranker.eval.sid_copy import run_sid_copy

    rows = [run_sid_copy(m, args.data, args.file, args.limit, greedy=args.greedy) for m in args.model]
    for r in rows:
        print(f"{r['model']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["by_level"].items())
              + f" ({r['examples']} examples of {r['file']})")
        split = [f"{lvl} {kind} {v['accuracy']:.3f} (n={v['tokens']})"
                 for lvl, kinds in r.get("by_prefix", {}).items() for kind, v in kinds.items()]
        if split:
            print("  by prefix (shared with another candidate or unique): " + ", ".join(split))
        if r.get("reasoning_by_level"):
            print("  SIDs in the reasoning (the decision's lookup): "
                  + ", ".join(f"{k} {v['accuracy']:.3f}" for k, v in r["reasoning_by_level"].items())
                  + f" (n={next(iter(r['reasoning_by_level'].values()))['tokens']})")
        if r.get("errors"):
            print("  wrong SID tokens: " + ", ".join(f"{k} {v}" for k, v in r["errors"].items()))
        if r.get("greedy"):
            g = r["greedy"]
            print(f"  greedy decoding: valid {g['valid_rate']:.3f}, the reference order {g['exact_rate']:.3f}"
                  + "".join(f", {k} {v}" for k, v in g["failures"].items()))
    payload = {"rows": rows}
    if args.out and args.add_to and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text(encoding="utf-8"))
        payload = {"rows": old.get("rows", []) + rows,
                   "commands": old.get("commands", [old.get("command")]) + [command_line()]}
    return save_results(args.out, payload)


def cmd_forward_cost(args) -> int:
    from reranker.eval.speed import format_forward_cost, run_forward_cost
    from reranker.model import build_model, load_model

    if bool(args.model) == bool(args.vocab):
        raise SystemExit("dgr2 forward-cost: give either --model DIR or --vocab N (with --size), not both")
    if args.model:
        model, name = load_model(args.model), f"model dir {Path(args.model).name}"
    else:
        model, name = build_model(args.vocab, args.size), f"random {args.size} Qwen3, vocab {args.vocab}"
    rep = run_forward_cost(model, args.context, ints(args.batch_sizes), ints(args.block_sizes), args.length,
                           args.iters, threads=args.threads, out_json=args.out, command=command_line(), model_name=name)
    print(format_forward_cost(rep))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def cmd_train_cost(args) -> int:
    import torch

    from reranker.eval.speed import machine_info, training_step_cost
    from reranker.model import build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    rep = training_step_cost(build_model(args.vocab, args.size), args.batch_size, args.length, args.iters)
    rep.update(kind="train-cost", machine={**machine, "torch_threads": torch.get_num_threads()},
               model=f"random {args.size} Qwen3, vocab {args.vocab}")
    for r in rep["rows"]:
        print(f"autocast {r['autocast']:>4s}: {r['seconds']['median']:.3f} s per step "
              f"[{r['seconds']['min']:.3f}-{r['seconds']['max']:.3f}]")
    print(f"speed-up {rep['speedup']:.2f}x ({args.batch_size} sequences of {args.length} tokens)")
    return save_results(args.out, rep)


def cmd_report(args) -> int:
    from .. import report as R

    if args.kind == "ar":
        if not args.eval:
            raise SystemExit("dgr2 report ar: --eval is required (the final AR model's report)")
        before = R.load_report(args.before) if args.before else None
        stages = dict(R.parse_pairs(args.stage, "--stage"))
        rep = R.ar_report(R.load_report(args.eval), args.data, before, stages, args.n_boot, args.seed)
    elif args.kind == "curves":
        rep = R.training_curves(R.parse_pairs(args.run, "--run"))
    else:
        rows = [(lab, R.load_report(p)) for lab, p in R.parse_pairs(args.row, "--row")]
        abl = [(lab, R.load_report(p)) for lab, p in R.parse_pairs(args.ablation, "--ablation")]
        rep = R.stages_report(rows, args.reference, abl, args.n_boot, args.seed)
    if args.note:
        rep["note"] = args.note
    return save_results(args.out, rep)


def cmd_results(args) -> int:
    """Export an existing artifacts directory's metrics.json as a docs/results file."""
    metrics = json.loads((Path(args.artifacts) / "metrics.json").read_text())
    if args.remeasure_hnsw:
        from candidate_gen.retrieve import remeasure_hnsw
        from reranker.service.retrieval import Retriever

        metrics["hnsw_recall@10_before_remeasure"] = metrics.get("hnsw_recall@10")
        metrics["hnsw_recall@10"] = remeasure_hnsw(args.artifacts, Retriever.load(args.artifacts).encoder)
        metrics["hnsw_remeasured_by"] = command_line()
        print(f"hnsw_recall@10 re-measured: {metrics['hnsw_recall@10']:.4f}")
    return save_results(args.out, metrics, args.command)


def cmd_bench(args) -> int:
    from ..bench import archive_result, build_benchmarks

    for f in args.archive:
        print(f"archived {f} -> {archive_result(Path(f))}")
    print(f"wrote {build_benchmarks(args.results, args.out, args.plots)}")
    return 0


def add_sid_copy(sub) -> None:
    sc = sub.add_parser("sid-copy", help="teacher-forced accuracy of the answer's SID tokens by level (can it copy?)")
    sc.add_argument("--model", action="append", required=True, help="model directory (repeatable)")
    sc.add_argument("--data", required=True, help="re-ranking data directory")
    sc.add_argument("--file", default="valid.jsonl", help="examples file in the data dir")
    sc.add_argument("--limit", type=int, default=64)
    sc.add_argument("--out", help="docs/results JSON file (sid-copy-<name>.json)")
    sc.add_argument("--add-to", action="store_true", help="append these rows to an existing --out file")
    sc.add_argument("--greedy", action="store_true",
                    help="also decode greedily and report how many answers are valid permutations of the "
                         "reference answer's SIDs (and how many equal it)")
    sc.set_defaults(func=cmd_sid_copy)


def add_forward_cost(sub) -> None:
    f = sub.add_parser("forward-cost", help="forward cost of block steps vs one-token steps, and the speed-up "
                                            "ceiling it puts on exact block diffusion (no trained model needed)")
    f.add_argument("--model", help="a model directory (its shapes are what count; the weights do not matter)")
    f.add_argument("--size", default="cpu", choices=["cpu", "tiny"], help="with --vocab: a random model of this size")
    f.add_argument("--vocab", type=int, help="with --size: vocabulary of the random model (Beauty's cpu model: 3032)")
    f.add_argument("--context", type=int, default=403, help="cached columns (the mean Beauty prompt: 403)")
    f.add_argument("--length", type=int, default=240, help="answer length for the ceiling (scan_brand answers: ~239)")
    f.add_argument("--batch-sizes", default="1,2,4,8,32")
    f.add_argument("--block-sizes", default="8,16,32,64")
    f.add_argument("--iters", type=int, default=20)
    f.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's current setting)")
    f.add_argument("--out", help="write docs/results/forward-cost-<name>.json")
    f.set_defaults(func=cmd_forward_cost)


def add_train_cost(sub) -> None:
    tc = sub.add_parser("train-cost", help="one training step with and without autocast bf16, side by side")
    tc.add_argument("--size", default="cpu", choices=["cpu", "tiny"])
    tc.add_argument("--vocab", type=int, default=3032)
    tc.add_argument("--batch-size", type=int, default=8)
    tc.add_argument("--length", type=int, default=640, help="tokens per sequence (Beauty: ~403 prompt + ~239 answer)")
    tc.add_argument("--iters", type=int, default=5)
    tc.add_argument("--threads", type=int, default=None)
    tc.add_argument("--out", help="write docs/results/train-cost-<name>.json")
    tc.set_defaults(func=cmd_train_cost)


def add_report(sub) -> None:
    rp = sub.add_parser("report", help="assemble docs/results files (AR report, stage table) from `dgr2 eval` reports")
    rp.add_argument("kind", choices=["ar", "stages", "curves"])
    rp.add_argument("--out", required=True)
    rp.add_argument("--eval", help="ar: the final AR model's eval report")
    rp.add_argument("--before", help="ar: the eval report of the model before the last stage (e.g. after sft)")
    rp.add_argument("--data", help="ar: re-ranking data dir (the baselines are recomputed on its test users)")
    rp.add_argument("--stage", action="append", default=[], help="ar: NAME=STAGE_OUTPUT_DIR (its wall-clock is reported)")
    rp.add_argument("--row", action="append", default=[], help="stages: LABEL=EVAL_REPORT, in table order")
    rp.add_argument("--ablation", action="append", default=[], help="stages: LABEL=EVAL_REPORT")
    rp.add_argument("--run", action="append", default=[], help="curves: LABEL=RUN_DIR (holds metrics.jsonl)")
    rp.add_argument("--reference", default="AR GR2", help="stages: the row every other row is compared with")
    rp.add_argument("--note", help="a sentence shown with the table (e.g. the training budget behind it)")
    rp.add_argument("--n-boot", type=int, default=2000)
    rp.add_argument("--seed", type=int, default=0)
    rp.set_defaults(func=cmd_report)


def add_results(sub) -> None:
    x = sub.add_parser("results", help="export an artifacts dir's metrics.json to docs/results")
    x.add_argument("--artifacts", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--command", required=True, help="the command that produced the artifacts")
    x.add_argument("--remeasure-hnsw", action="store_true",
                   help="re-measure HNSW recall@10 with the current index code on the saved model")
    x.set_defaults(func=cmd_results)


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="rebuild docs/BENCHMARKS.md and docs/plots/*.png from docs/results/*.json")
    b.add_argument("--results", default="docs/results", help="directory of result JSON files")
    b.add_argument("--out", default="docs/BENCHMARKS.md")
    b.add_argument("--plots", default=None, help="PNG directory (default: <out's folder>/plots)")
    b.add_argument("--archive", nargs="+", default=[], metavar="FILE",
                   help="first move these results files (runs a new run replaces) to <results>/archive/, "
                        "named by their recorded date")
    b.set_defaults(func=cmd_bench)
