"""`dgr2`: the command-line entry point. One sub-command per job; each maps to one function."""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

from candidate_gen.files import parse_json_object, write_result

from .config import ConfigError, load_config, retrieval_settings, section


def _command() -> str:
    """This invocation, shell-quoted: the provenance every results file records."""
    return "dgr2 " + shlex.join(sys.argv[1:])


def _save_results(path, doc: dict, command: str | None = None) -> int:
    """Write `doc` as a docs/results file at `path`, when a path was given, and say so; the command
    recorded is this invocation unless another is given. Returns 0, a command's exit status."""
    if path:
        write_result(path, doc, command if command is not None else _command())
        print(f"results written to {path}")
    return 0


def cmd_retrieve(args) -> int:
    from candidate_gen.retrieve import run_retrieval

    cfg = load_config(args.config)
    res = run_retrieval(retrieval_settings(cfg, args.data, args.out))
    print(format_retrieval(res))
    return _save_results(args.results, res)


def cmd_results(args) -> int:
    """Export an existing artifacts directory's metrics.json as a docs/results file."""
    metrics = json.loads((Path(args.artifacts) / "metrics.json").read_text())
    if args.remeasure_hnsw:
        from candidate_gen.retrieve import remeasure_hnsw
        from reranker.service.retrieval import Retriever

        metrics["hnsw_recall@10_before_remeasure"] = metrics.get("hnsw_recall@10")
        metrics["hnsw_recall@10"] = remeasure_hnsw(args.artifacts, Retriever.load(args.artifacts).encoder)
        metrics["hnsw_remeasured_by"] = _command()
        print(f"hnsw_recall@10 re-measured: {metrics['hnsw_recall@10']:.4f}")
    return _save_results(args.out, metrics, args.command)


def _ints(s: str) -> tuple[int, ...]:
    """A comma-separated CLI list ("1,8"; "" is empty)."""
    return tuple(int(x) for x in s.split(",") if x.strip())


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def cmd_speed(args) -> int:
    from reranker.speed import format_speed, run_speed_benchmark

    rep = run_speed_benchmark(
        args.ar, args.diffusion, args.data, args.out, n_prompts=args.n_prompts, split=args.split,
        command=_command(), accuracy=not args.no_accuracy, accuracy_limit=args.accuracy_limit,
        batch_sizes=_ints(args.batch_sizes), taus=_floats(args.taus), block_size=args.block_size,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup, threads=args.threads,
        lengths=_ints(args.lengths), length_taus=_floats(args.length_taus), forward_blocks=_ints(args.forward_blocks),
        progress=logging.getLogger("dgr2.speed").info, commit_rule=args.commit_rule, hold_eos=args.hold_eos)
    print(format_speed(rep))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def cmd_forward_cost(args) -> int:
    from reranker.model import build_model, load_model
    from reranker.speed import format_forward_cost, run_forward_cost

    if bool(args.model) == bool(args.vocab):
        raise SystemExit("dgr2 forward-cost: give either --model DIR or --vocab N (with --size), not both")
    if args.model:
        model, name = load_model(args.model), f"model dir {Path(args.model).name}"
    else:
        model, name = build_model(args.vocab, args.size), f"random {args.size} Qwen3, vocab {args.vocab}"
    rep = run_forward_cost(model, args.context, _ints(args.batch_sizes), _ints(args.block_sizes), args.length,
                           args.iters, threads=args.threads, out_json=args.out, command=_command(), model_name=name)
    print(format_forward_cost(rep))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def cmd_train_cost(args) -> int:
    import torch

    from reranker.model import build_model
    from reranker.speed import machine_info, training_step_cost

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
    return _save_results(args.out, rep)


def cmd_bench(args) -> int:
    from .bench import build_benchmarks

    print(f"wrote {build_benchmarks(args.results, args.out, args.plots)}")
    return 0


def cmd_pipeline(args) -> int:
    """The whole pipeline from a config; prints the stage table."""
    import time

    from .pipeline import format_summary, run_full_pipeline

    t0 = time.time()
    cfg = load_config(args.config)
    summary = run_full_pipeline(cfg, data_override=getattr(args, "data", None))
    print()
    print(f"retrieval: Recall@10 {summary['retrieval']['recall@10']:.4f} (RecBole standard), "
          f"{summary['retrieval']['recall@10_masked']:.4f} (history masked)")
    print(format_summary(summary))
    from .plots import plot_stage_summary

    plot = plot_stage_summary(summary, Path(cfg["out"]) / "plots" / "stages.png", f"Stage table ({cfg.get('name')})")
    print(f"\nsummary: {Path(cfg['out']) / 'summary.json'}; per-row reports: {Path(cfg['out']) / 'eval'}"
          + (f"; plot: {plot}" if plot else "") + f"  ({time.time() - t0:.0f} s)")
    if getattr(args, "results", None):
        write_result(args.results, summary, _command())
    return 0


cmd_demo = cmd_pipeline


def cmd_eval(args) -> int:
    from reranker.engine import DecodeOptions
    from reranker.evaluate import evaluate_dirs, format_report, write_outputs

    opts = DecodeOptions(decoder=args.decoder, tau=args.tau, block_size=args.block_size,
                         max_new_tokens=args.max_new_tokens, commit_rule=args.commit_rule, hold_eos=args.hold_eos)
    rep = evaluate_dirs(args.model, args.data, args.split, opts, args.batch_size, args.limit,
                        keep_outputs=bool(args.outputs))
    print(format_report(rep))
    if args.outputs:
        write_outputs(args.outputs, rep.pop("outputs"))  # beside the report, not inside it
        print(f"per-example outputs written to {args.outputs}")
    return _save_results(args.out, rep)


def cmd_convert(args) -> int:
    from reranker.convert import convert_to_diffusion

    convert_to_diffusion(args.src, args.dst, block_size=args.block_size)
    print(f"converted {args.src} -> {args.dst} (block size {args.block_size})")
    return 0


def cmd_model_export(args) -> int:
    from reranker.training.checkpoint import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.like, args.out)
    print(f"model of {args.checkpoint} written to {out}")
    return 0


def cmd_model_average(args) -> int:
    from reranker.model import average_models

    out = average_models(args.models, args.out)
    print(f"average of {len(args.models)} models written to {out}")
    return 0


def cmd_model_init(args) -> int:
    from reranker.init_model import init_model

    out = init_model(args.data, args.out, size=args.size, base=args.base, seed=args.seed)
    print(f"initial model written to {out}")
    return 0


def _json_arg(text: str, flag: str) -> dict:
    """A flag's JSON object of settings; anything else exits with a message naming the flag and its text."""
    try:
        return parse_json_object(text, flag)
    except ValueError as e:
        raise SystemExit(f"{e}: {text!r}") from None


def cmd_train(args) -> int:
    from reranker.stages.pipeline import run_stage

    config = _json_arg(args.config_json, "--config-json") if args.config_json else {}
    if args.config:
        cfg = load_config(args.config)
        config = {**(section(section(cfg, "stages"), args.stage)), **config}
    summary = run_stage(args.stage, args.input, args.output, args.data, config, runs_dir=args.runs,
                        seed=args.seed, force=args.force)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_serve(args) -> int:
    from reranker.service.server import serve_from_args

    return serve_from_args(args)


def _data_paths(cfg: dict, data: str | None):
    """(retrieval artifacts dir, items file, re-ranking data dir) for a config."""
    from candidate_gen.atomic import find_atomic_file

    rs = retrieval_settings(cfg, data, None)
    src = rs.data_dir if rs.data_dir is not None else Path(rs.out) / "source"
    dcfg = section(cfg, "rerank_data")
    items = dcfg.get("items_path") or find_atomic_file(src, "item")
    return rs.out, Path(items), Path(cfg["out"]) / "rerank_data"


def cmd_data_build(args) -> int:
    from reranker.dataset import build_rerank_data

    override = _json_arg(args.config_json, "--config-json") if args.config_json else {}
    cfg = load_config(args.config)
    retrieval_dir, items, out = _data_paths(cfg, args.data)
    opts = {k: v for k, v in section(cfg, "rerank_data").items() if k != "items_path"}
    opts.update(override)
    report = build_rerank_data(retrieval_dir, items, Path(args.out) if args.out else out,
                               seed=int(cfg.get("seed", 0)), **opts)
    print(json.dumps(report, indent=2, default=str))
    return 0


def cmd_data_copy_warmup(args) -> int:
    from reranker.copy_warmup import build_copy_warmup

    out = build_copy_warmup(args.data, args.out_name, seed=args.seed, limit=args.limit, source=args.source,
                            full_prompt=args.full_prompt, random_sids=args.random_sids, out_path=args.out,
                            straight=args.straight, trace_style=args.trace_style,
                            relabel_last_code=args.relabel_last_code)
    print(f"copy warm-up examples written to {out}")
    return 0


def cmd_data_retrace(args) -> int:
    from reranker.retrace import retrace_data

    out = retrace_data(args.data, args.out, style=args.style)
    print(f"{out['style']} traces written to {out['out']}: " + ", ".join(f"{k} {v}" for k, v in out["examples"].items()))
    return 0


def cmd_sid_copy(args) -> int:
    from reranker.sid_copy import run_sid_copy

    rows = [run_sid_copy(m, args.data, args.file, args.limit, greedy=args.greedy) for m in args.model]
    for r in rows:
        print(f"{r['model']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["by_level"].items())
              + f" ({r['examples']} examples of {r['file']})")
        split = [f"{lvl} {kind} {v['accuracy']:.3f} (n={v['tokens']})"
                 for lvl, kinds in r.get("by_prefix", {}).items() for kind, v in kinds.items()]
        if split:
            print("  by prefix (shared with another candidate or unique): " + ", ".join(split))
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
                   "commands": old.get("commands", [old.get("command")]) + [_command()]}
    return _save_results(args.out, payload)


def cmd_report(args) -> int:
    from . import report as R

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
    return _save_results(args.out, rep)


def cmd_baselines(args) -> int:
    from reranker.baselines import baselines_table, run_baselines

    cfg = load_config(args.config)
    _, _, data_dir = _data_paths(cfg, None)
    res = run_baselines(args.data_dir or data_dir, seed=int(cfg.get("seed", 0)))
    print(baselines_table(res))
    return _save_results(args.results, res)


def cmd_e2e(args) -> int:
    """SASRec alone vs SASRec + re-rankers, with RecBole's own Trainer.evaluate (integration/e2e.py)."""
    from .e2e import format_e2e, parse_reranker, run_e2e

    cfg = load_config(args.config)
    rerankers = [parse_reranker(s) for s in args.reranker]
    if args.add_to and not (args.out and Path(args.out).is_file()):
        raise FileNotFoundError(f"--add-to needs an existing --out file, got {args.out!r}")
    res = run_e2e(cfg, rerankers, args.users, args.seed, args.batch_size, args.tau, commit_rule=args.commit_rule,
                  hold_eos=args.hold_eos)
    command = _command()
    if args.add_to:
        from .e2e import merge_into

        old = json.loads(Path(args.out).read_text(encoding="utf-8"))
        res = merge_into(old, res)
        command = "; ".join(c for c in (old.get("command"), command) if c)
    print(format_e2e(res))
    return _save_results(args.out, res, command)


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


def _add_diffusion_rule_flags(parser) -> None:
    """The diffusion decoder's commit rule and EOS hold, the same flags for every command that decodes."""
    from reranker.decoding.rules import COMMIT_RULES

    parser.add_argument("--hold-eos", action="store_true",
                        help="diffusion: commit EOS only as the position a step must commit, not on confidence "
                             "beside the tokens before it")
    parser.add_argument("--commit-rule", default="confidence", choices=COMMIT_RULES,
                        help="diffusion: commit every confident position (the paper's), or only the leftmost "
                             "masked one and the confident run after it")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgr2", description="Diffusion-GR2 re-ranking plugin")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("retrieve", help="train SASRec, build the FAISS index and candidate lists")
    r.add_argument("--config", required=True)
    r.add_argument("--data", help="directory with <name>.inter / <name>.item (overrides the config)")
    r.add_argument("--out", help="artifacts directory (overrides the config)")
    r.add_argument("--results", help="also write the metrics to this docs/results JSON file")
    r.set_defaults(func=cmd_retrieve)
    x = sub.add_parser("results", help="export an artifacts dir's metrics.json to docs/results")
    x.add_argument("--artifacts", required=True)
    x.add_argument("--out", required=True)
    x.add_argument("--command", required=True, help="the command that produced the artifacts")
    x.add_argument("--remeasure-hnsw", action="store_true",
                   help="re-measure HNSW recall@10 with the current index code on the saved model")
    x.set_defaults(func=cmd_results)
    b = sub.add_parser("bench", help="rebuild docs/BENCHMARKS.md and docs/plots/*.png from docs/results/*.json")
    b.add_argument("--results", default="docs/results", help="directory of result JSON files")
    b.add_argument("--out", default="docs/BENCHMARKS.md")
    b.add_argument("--plots", default=None, help="PNG directory (default: <out's folder>/plots)")
    b.set_defaults(func=cmd_bench)
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
    s = sub.add_parser("speed", help="decode speed: block diffusion vs AR side by side (+ accuracy per tau)")
    s.add_argument("--ar", required=True, help="AR model directory")
    s.add_argument("--diffusion", required=True, help="converted (diffusion) model directory")
    s.add_argument("--data", required=True, help="re-ranking data directory (prompts and accuracy examples)")
    s.add_argument("--split", default="test", choices=["train", "valid", "test"])
    s.add_argument("--out", help="write the report to this docs/results JSON file (diffusion-speed-<name>.json)")
    s.add_argument("--n-prompts", type=int, default=8, help="prompts timed per run (first N of the split)")
    s.add_argument("--batch-sizes", default="1,8")
    s.add_argument("--taus", default="1.0,0.9,0.8,0.6,0.4")
    s.add_argument("--block-size", type=int, default=None, help="default: the one recorded in the model")
    s.add_argument("--max-new-tokens", type=int, default=320)
    _add_diffusion_rule_flags(s)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's current setting)")
    s.add_argument("--lengths", default="64,128,256", help="output-length curve, EOS disabled ('' to skip)")
    s.add_argument("--length-taus", default="0.9,1.0")
    s.add_argument("--forward-blocks", default="8,16,32", help="forward-cost microbenchmark ('' to skip)")
    s.add_argument("--no-accuracy", action="store_true", help="skip Recall@1 / valid rate per tau")
    s.add_argument("--accuracy-limit", type=int, default=None, help="accuracy on the first N examples only")
    s.set_defaults(func=cmd_speed)
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
    tc = sub.add_parser("train-cost", help="one training step with and without autocast bf16, side by side")
    tc.add_argument("--size", default="cpu", choices=["cpu", "tiny"])
    tc.add_argument("--vocab", type=int, default=3032)
    tc.add_argument("--batch-size", type=int, default=8)
    tc.add_argument("--length", type=int, default=640, help="tokens per sequence (Beauty: ~403 prompt + ~239 answer)")
    tc.add_argument("--iters", type=int, default=5)
    tc.add_argument("--threads", type=int, default=None)
    tc.add_argument("--out", help="write docs/results/train-cost-<name>.json")
    tc.set_defaults(func=cmd_train_cost)
    e = sub.add_parser("eval", help="re-rank a split with a model and report metrics with CIs")
    e.add_argument("--model", required=True, help="model directory (AR or converted diffusion)")
    e.add_argument("--data", required=True, help="re-ranking data directory (dgr2 data build)")
    e.add_argument("--split", default="test", choices=["train", "valid", "test"])
    e.add_argument("--decoder", default="ar", choices=["ar", "diffusion"])
    e.add_argument("--tau", type=float, default=0.9)
    _add_diffusion_rule_flags(e)
    e.add_argument("--block-size", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=320)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--limit", type=int, default=None, help="evaluate the first N examples only")
    e.add_argument("--out", help="write the report to this docs/results JSON file")
    e.add_argument("--outputs", help="write each example's generated text, parse result and failure kind to this "
                                     "JSONL file")
    e.set_defaults(func=cmd_eval)
    c = sub.add_parser("convert", help="convert an AR model directory into a block-diffusion model")
    c.add_argument("--from", dest="src", required=True)
    c.add_argument("--to", dest="dst", required=True)
    c.add_argument("--block-size", type=int, default=32)
    c.set_defaults(func=cmd_convert)
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
    dr.add_argument("--style", default="brief", choices=["brief", "scan", "scan_recent", "scan_brand"],
                    help="brief: the decision sentence alone, same rankings; scan: a co-purchase scan "
                    "then the decision, rankings replaced by the scan's pick first; scan_recent: the same over "
                    "the counts after the last 3 items; scan_brand: scan_recent with "
                    "same-brand history counts breaking ties (see "
                    "reranker/teachers/traces.py brief_trace, scan_trace)")
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
    dc.add_argument("--full-prompt", action="store_true",
                    help="keep each list's real prompt (history, evidence) instead of a short list of SIDs")
    dc.add_argument("--random-sids", action="store_true",
                    help="relabel every SID at random: the model must copy, it cannot recall the catalogue")
    dc.add_argument("--relabel-last-code", action="store_true",
                    help="with --random-sids: draw the dedup (last) code too, so rare dedup tokens get copied")
    dc.add_argument("--trace-style", choices=["scan", "scan_recent", "scan_brand"],
                    help="answer each real prompt with this rule-scan trace and pick (as retrace does) "
                    "instead of the 'put #k first' copy task")
    dc.set_defaults(func=cmd_data_copy_warmup)
    bl = sub.add_parser("baselines", help="retriever order, random, co-purchase sorts (last item; last 3 items then brand), learned scorer (with CIs)")
    bl.add_argument("--config", required=True)
    bl.add_argument("--data-dir", help="re-ranking data directory (default <out>/rerank_data)")
    bl.add_argument("--results", help="write the result to this docs/results JSON file")
    bl.set_defaults(func=cmd_baselines)
    ee = sub.add_parser("e2e", help="RecBole Trainer.evaluate: SASRec alone vs SASRec + each re-ranker")
    ee.add_argument("--config", required=True)
    ee.add_argument("--reranker", action="append", default=[],
                    help="NAME=MODEL_DIR:DECODER (DECODER ar | diffusion); repeat for more rows")
    ee.add_argument("--users", type=int, default=None, help="a seeded random sample of N test users (default: all)")
    ee.add_argument("--seed", type=int, default=0, help="seed of the user sample")
    ee.add_argument("--batch-size", type=int, default=32, help="re-ranker decode batch size")
    ee.add_argument("--tau", type=float, default=0.9, help="diffusion confidence threshold")
    _add_diffusion_rule_flags(ee)
    ee.add_argument("--out", help="write the result to this docs/results JSON file (recbole-e2e-<name>.json)")
    ee.add_argument("--add-to", action="store_true",
                    help="add these rows to the existing --out file (same users; its SASRec-alone row must match)")
    ee.set_defaults(func=cmd_e2e)
    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("init", help="a fresh small Qwen3 over the data's tokenizer, or a local checkpoint + our tokens")
    mi.add_argument("--data", help="re-ranking data directory (its tokenizer/ is used for a fresh model)")
    mi.add_argument("--out", required=True)
    mi.add_argument("--size", default="cpu", help="cpu | tiny")
    mi.add_argument("--base", help="a local Hugging Face causal-LM directory to start from instead")
    mi.add_argument("--seed", type=int, default=0)
    mi.set_defaults(func=cmd_model_init)
    me = msub.add_parser("export", help="a model directory from a training checkpoint (probe a running stage)")
    me.add_argument("--checkpoint", required=True, help="<runs>/<stage>/checkpoints/stepNNNNNNNN-<tag>.pt")
    me.add_argument("--like", required=True, help="the stage's input model directory (architecture, tokenizer)")
    me.add_argument("--out", required=True)
    me.set_defaults(func=cmd_model_export)
    ma = msub.add_parser("average", help="a model directory whose weights average several of one architecture")
    ma.add_argument("models", nargs="+", help="model directories (the first gives config and tokenizer)")
    ma.add_argument("--out", required=True)
    ma.set_defaults(func=cmd_model_average)
    t = sub.add_parser("train", help="run one training stage (a registered plugin: sft, ar_rl, cft, opd, rl, ...)")
    t.add_argument("stage")
    t.add_argument("--input", required=True, help="input model directory")
    t.add_argument("--output", required=True, help="output model directory")
    t.add_argument("--data", required=True, help="re-ranking data directory")
    t.add_argument("--config", help="YAML run config; its stages.<stage> section is used")
    t.add_argument("--config-json", help="stage settings as JSON (override the YAML)")
    t.add_argument("--runs", help="runs directory for checkpoints and TensorBoard")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="redo the stage even if it is complete")
    t.set_defaults(func=cmd_train)
    from reranker.service.options import add_serve_arguments

    sv = sub.add_parser("serve", help="serve Rerank / Recommend over gRPC")
    add_serve_arguments(sv)
    sv.set_defaults(func=cmd_serve)
    cl = sub.add_parser("client", help="call a running server: rerank | recommend | health", add_help=False)
    cl.add_argument("rest", nargs=argparse.REMAINDER)
    cl.set_defaults(func=lambda a: __import__("reranker.service.client", fromlist=["client_main"]).client_main(a.rest))
    lt = sub.add_parser("loadtest", help="load-test a running server on loopback", add_help=False)
    lt.add_argument("rest", nargs=argparse.REMAINDER)
    lt.set_defaults(func=lambda a: __import__("reranker.service.loadtest", fromlist=["main"]).main(a.rest))
    pl = sub.add_parser("pipeline", help="retrieval -> data -> sft -> ar_rl -> convert -> cft -> opd -> rl -> eval")
    pl.add_argument("--config", required=True)
    pl.add_argument("--data", help="directory with <name>.inter / <name>.item (overrides the config)")
    pl.add_argument("--results", help="also write the summary to this docs/results JSON file")
    pl.set_defaults(func=cmd_pipeline)
    d = sub.add_parser("demo", help="run the main job on the embedded synthetic default")
    d.add_argument("--config", default="configs/demo.yaml")
    d.set_defaults(func=cmd_demo)
    return p


# Subcommands with their own argument parsers: everything after the name is theirs (argparse's
# REMAINDER would refuse a leading option such as -h).
_PASS_THROUGH = {"client": ("reranker.service.client", "client_main"), "loadtest": ("reranker.service.loadtest", "main")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _PASS_THROUGH:
        module, func = _PASS_THROUGH[argv[0]]
        return getattr(__import__(module, fromlist=[func]), func)(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"dgr2 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
