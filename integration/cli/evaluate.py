"""`dgr2 eval`, `dgr2 speed`, `dgr2 baselines` and `dgr2 e2e`: accuracy, decode speed, the non-LM
baselines and the RecBole end-to-end comparison."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from reranker.decoding import add_decode_flags, explicit_from_args

from ..config import load_config
from .common import command_line, data_paths, floats, ints, save_results


def cmd_eval(args) -> int:
    from reranker.eval.evaluate import evaluate_dirs, format_report, write_outputs

    # settings not given on the command line: the model's recorded ones (reranker.decoding)
    rep = evaluate_dirs(args.model, args.data, args.split, None, args.batch_size, args.limit,
                        keep_outputs=bool(args.outputs), settings=explicit_from_args(args), workers=args.workers)
    print(format_report(rep))
    if args.outputs:
        write_outputs(args.outputs, rep.pop("outputs"))  # beside the report, not inside it
        print(f"per-example outputs written to {args.outputs}")
    return save_results(args.out, rep)


def cmd_speed(args) -> int:
    from reranker.eval.speed import format_speed, run_speed_benchmark

    rep = run_speed_benchmark(
        args.ar, args.diffusion, args.data, args.out, n_prompts=args.n_prompts, split=args.split,
        command=command_line(), accuracy=not args.no_accuracy, accuracy_limit=args.accuracy_limit,
        batch_sizes=ints(args.batch_sizes), taus=floats(args.taus), block_size=args.block_size,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup, threads=args.threads,
        lengths=ints(args.lengths), length_taus=floats(args.length_taus), forward_blocks=ints(args.forward_blocks),
        progress=logging.getLogger("dgr2.speed").info, commit_rule=args.commit_rule, hold_eos=args.hold_eos,
        exact_decoders=[d for d in args.exact_decoders.split(",") if d], schedule=args.schedule,
        window=args.window, reuse_settled=args.reuse_settled, lookup_drafts=args.lookup_drafts,
        compute_dtype=args.compute_dtype)
    print(format_speed(rep))
    if args.out:
        print(f"results written to {args.out}")
    return 0


def cmd_baselines(args) -> int:
    from reranker.eval.baselines import baselines_table, run_baselines

    cfg = load_config(args.config)
    _, _, data_dir = data_paths(cfg, None)
    res = run_baselines(args.data_dir or data_dir, seed=int(cfg.get("seed", 0)), split=args.split)
    print(baselines_table(res))
    return save_results(args.results, res)


def cmd_e2e(args) -> int:
    """SASRec alone vs SASRec + re-rankers, with RecBole's own Trainer.evaluate (integration/e2e.py)."""
    from ..e2e import format_e2e, parse_reranker, run_e2e

    cfg = load_config(args.config)
    if args.run:
        cfg["out"] = args.run  # the `dgr2 pipeline --out` directory: its retrieval and rerank_data
    rerankers = [parse_reranker(s) for s in args.reranker]
    if args.add_to and not (args.out and Path(args.out).is_file()):
        raise FileNotFoundError(f"--add-to needs an existing --out file, got {args.out!r}")
    res = run_e2e(cfg, rerankers, args.users, args.seed, args.batch_size, args.tau, commit_rule=args.commit_rule,
                  hold_eos=args.hold_eos, workers=args.workers)
    command = command_line()
    if args.add_to:
        from ..e2e import merge_into

        old = json.loads(Path(args.out).read_text(encoding="utf-8"))
        res = merge_into(old, res)
        command = "; ".join(c for c in (old.get("command"), command) if c)
    print(format_e2e(res))
    return save_results(args.out, res, command)


def add_eval(sub) -> None:
    e = sub.add_parser("eval", help="re-rank a split with a model and report metrics with CIs")
    e.add_argument("--model", required=True, help="model directory (AR or converted diffusion)")
    e.add_argument("--data", help="re-ranking data directory (dgr2 data build) or a release bundle (dgr2 release); "
                                  "default: the bundle the model lies in")
    e.add_argument("--split", default="test", choices=["train", "valid", "test"])
    add_decode_flags(e)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--workers", type=int, default=1,
                   help="batches decoded at once, on that many threads sharing torch's (2 on a 2-core CPU: about "
                        "1.9x the lists per second of 1)")
    e.add_argument("--limit", type=int, default=None, help="evaluate the first N examples only")
    e.add_argument("--out", help="write the report to this docs/results JSON file")
    e.add_argument("--outputs", help="write each example's generated text, parse result and failure kind to this "
                                     "JSONL file")
    e.set_defaults(func=cmd_eval)


def add_speed(sub) -> None:
    s = sub.add_parser("speed", help="decode speed: block diffusion vs AR, HF generate and AR + prompt lookup, "
                                     "side by side (+ accuracy per point)")
    s.add_argument("--ar", required=True, help="AR model directory")
    s.add_argument("--diffusion", required=True, help="converted (diffusion) model directory")
    s.add_argument("--data", help="re-ranking data directory or release bundle (prompts and accuracy examples); "
                                  "default: the bundle the diffusion model lies in")
    s.add_argument("--split", default="test", choices=["train", "valid", "test"])
    s.add_argument("--out", help="write the report to this docs/results JSON file (diffusion-speed-<name>.json)")
    s.add_argument("--n-prompts", type=int, default=8, help="prompts timed per run (first N of the split)")
    s.add_argument("--batch-sizes", default="1,8")
    s.add_argument("--taus", default="1.0,0.9,0.8,0.6,0.4")
    s.add_argument("--exact-decoders", default="hf_generate,ar_lookup",
                   help="AR-exact decoders timed beside AR on the AR model: Hugging Face generate, prompt-lookup "
                        "drafting ('' for none)")
    add_decode_flags(s, ("block_size", "max_new_tokens", "commit_rule", "hold_eos", "window", "reuse_settled",
                         "lookup_drafts", "compute_dtype"),
                     {"compute_dtype": "the diffusion decode's matmul precision (default: the model's recorded one, "
                                       "else float32); AR is timed in float32, and also in this one when it is not "
                                       "float32, so the faster AR is shown"})
    s.add_argument("--schedule", default="lockstep", choices=["lockstep", "independent"],
                   help="diffusion batches: rows through each block together, or each row through its own")
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's current setting)")
    s.add_argument("--lengths", default="64,128,256", help="output-length curve, EOS disabled ('' to skip)")
    s.add_argument("--length-taus", default="0.9,1.0")
    s.add_argument("--forward-blocks", default="8,16,32", help="forward-cost microbenchmark ('' to skip)")
    s.add_argument("--no-accuracy", action="store_true", help="skip Recall@1 / valid rate per tau")
    s.add_argument("--accuracy-limit", type=int, default=None, help="accuracy on the first N examples only")
    s.set_defaults(func=cmd_speed)


def add_baselines(sub) -> None:
    bl = sub.add_parser("baselines", help="retriever order, random, co-purchase sorts (last item; last 3 items then brand), learned scorer (with CIs)")
    bl.add_argument("--config", required=True)
    bl.add_argument("--data-dir", help="re-ranking data directory (default <out>/rerank_data)")
    bl.add_argument("--split", default="test",
                    help="test: the test users (the published baselines); valid: the selection users' "
                    "validation lists, the learned scorer cross-fitted over two halves of them (for choices "
                    "that must not read the test split)")
    bl.add_argument("--results", help="write the result to this docs/results JSON file")
    bl.set_defaults(func=cmd_baselines)


def add_e2e(sub) -> None:
    ee = sub.add_parser("e2e", help="RecBole Trainer.evaluate: SASRec alone vs SASRec + each re-ranker")
    ee.add_argument("--config", required=True)
    ee.add_argument("--run", help="the `dgr2 pipeline --out` directory to read retrieval and re-ranking data from "
                                  "(default: the config's out)")
    ee.add_argument("--reranker", action="append", default=[],
                    help="NAME=MODEL_DIR:DECODER (DECODER ar | ar_lookup | diffusion); repeat for more rows")
    ee.add_argument("--users", type=int, default=None, help="a seeded random sample of N test users (default: all)")
    ee.add_argument("--seed", type=int, default=0, help="seed of the user sample")
    ee.add_argument("--batch-size", type=int, default=32, help="re-ranker decode batch size")
    ee.add_argument("--workers", type=int, default=None,
                    help="batches decoded at once, on that many threads sharing torch's (default: the config's "
                         "eval.workers, else 1)")
    add_decode_flags(ee, ("tau", "commit_rule", "hold_eos"))
    ee.add_argument("--out", help="write the result to this docs/results JSON file (recbole-e2e-<name>.json)")
    ee.add_argument("--add-to", action="store_true",
                    help="add these rows to the existing --out file (same users; its SASRec-alone row must match)")
    ee.set_defaults(func=cmd_e2e)
