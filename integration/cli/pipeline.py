"""`dgr2 pipeline` and `dgr2 demo`: every step from a config, and the stage table; `dgr2 release`: a
finished run's models and what serving them needs, as one self-contained bundle."""
from __future__ import annotations

from pathlib import Path

from candidate_gen.files import write_result

from ..config import load_config
from .common import command_line


def cmd_pipeline(args) -> int:
    """The whole pipeline from a config; prints the stage table."""
    import time

    import sys

    from reranker.eval.speed import machine_info

    from ..config import section
    from ..phases import check_stages
    from ..pipeline import (finish_invocation, format_summary, public_argv, read_invocations, run_full_pipeline,
                            start_invocation)

    t0 = time.time()
    cfg = load_config(args.config)
    if getattr(args, "out", None):
        cfg["out"] = args.out
    check_stages(section(cfg, "stages"))  # a bad setting leaves no record of a call in --out
    summary_only = getattr(args, "summary_only", False)
    # a --summary-only call made nothing, so it is not one of the calls that made the run
    inv = None if summary_only else start_invocation(Path(cfg["out"]), sys.argv[1:])
    summary = run_full_pipeline(cfg, data_override=getattr(args, "data", None), only_until=getattr(args, "until", None),
                                summary_only=summary_only)
    invocations = (finish_invocation(Path(cfg["out"]), inv, time.time() - t0) if inv is not None
                   else read_invocations(Path(cfg["out"])))
    # where the data and the run lived is this machine's business: the record names them by role
    invocations = [{**i, "argv": public_argv(i["argv"])} for i in invocations]
    if getattr(args, "record", None) and not getattr(args, "until", None):
        # the run's cost: each step's seconds as recorded with its output, and every call that made it
        write_result(args.record, {"name": cfg.get("name"), "stage_seconds": summary["stage_seconds"],
                                   "total_seconds": summary["total_seconds"], "machine": machine_info(),
                                   "resumed": len(invocations) > 1, "invocations": invocations},
                     command_line())
    if getattr(args, "until", None):
        print(f"stopped after {args.until!r}: {cfg['out']}  ({time.time() - t0:.0f} s)")
        return 0
    print()
    print(f"retrieval: Recall@10 {summary['retrieval']['recall@10']:.4f} (RecBole standard), "
          f"{summary['retrieval']['recall@10_masked']:.4f} (history masked)")
    print(format_summary(summary))
    from ..plots import plot_stage_summary

    plot = plot_stage_summary(summary, Path(cfg["out"]) / "plots" / "stages.png", f"Stage table ({cfg.get('name')})")
    print(f"\nsummary: {Path(cfg['out']) / 'summary.json'}; per-row reports: {Path(cfg['out']) / 'eval'}"
          + (f"; plot: {plot}" if plot else "") + f"  ({time.time() - t0:.0f} s)")
    if getattr(args, "results", None):
        write_result(args.results, summary, command_line())
    return 0


cmd_demo = cmd_pipeline


def add_pipeline(sub) -> None:
    pl = sub.add_parser("pipeline", help="retrieval -> data -> sft -> ar_rl -> convert -> cft -> opd -> rl -> eval")
    pl.add_argument("--config", required=True)
    pl.add_argument("--data", help="directory with <name>.inter / <name>.item (overrides the config)")
    pl.add_argument("--out", help="output directory (overrides the config's `out`; may live outside the work tree, "
                    "and a later run with the same --out resumes it)")
    pl.add_argument("--until", choices=["data"], help="stop after this step (the rest runs on a later call)")
    pl.add_argument("--summary-only", action="store_true",
                    help="run no step: read back a finished run and write its summary (and --results/--record); "
                         "a step not done with these settings and this code is an error naming it")
    pl.add_argument("--results", help="also write the summary to this docs/results JSON file")
    pl.add_argument("--record", help="also write the run's cost (seconds per step, total, machine, load, each "
                    "call that made it) to this docs/results JSON file")
    pl.set_defaults(func=cmd_pipeline)


def add_demo(sub) -> None:
    d = sub.add_parser("demo", help="run the main job on the embedded synthetic default")
    d.add_argument("--config", default="configs/demo.yaml")
    d.set_defaults(func=cmd_demo)


def cmd_release(args) -> int:
    from ..release import release, verify_release

    if args.verify:
        problems = verify_release(args.verify)
        print("\n".join(problems) if problems else f"{args.verify}: every file matches release.json")
        return 1 if problems else 0
    if not (args.run and args.out):
        raise ValueError("give --run and --out (or --verify BUNDLE)")
    doc = release(args.run, args.out, config=args.config, force=args.force, max_mb=args.max_mb)
    print(f"released {args.run} to {args.out}: {len(doc['files'])} files, {doc['total_bytes'] / 1e6:.1f} MB; "
          + ", ".join(f"{k} {v['model_sha256'][:16]}" for k, v in doc["models"].items()))
    return 0


def add_release(sub) -> None:
    from ..release import MAX_MB

    r = sub.add_parser("release", help="bundle a finished pipeline run: teacher, student, evidence, test prompts, "
                                       "model card, release.json")
    r.add_argument("--run", help="the `dgr2 pipeline` output directory (its `out`)")
    r.add_argument("--out", help="the bundle directory to write (refused when it exists)")
    r.add_argument("--config", help="the recipe file the run was made from (default: the run's recipe.json)")
    r.add_argument("--force", action="store_true", help="replace an existing bundle")
    r.add_argument("--max-mb", type=float, default=MAX_MB, help="refuse a bundle heavier than this")
    r.add_argument("--verify", metavar="BUNDLE", help="check a bundle's files against its release.json instead")
    r.set_defaults(func=cmd_release)
