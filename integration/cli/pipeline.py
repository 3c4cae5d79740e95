"""`dgr2 pipeline` and `dgr2 demo`: every step from a config, and the stage table."""
from __future__ import annotations

from pathlib import Path

from candidate_gen.files import write_result

from ..config import load_config
from .common import command_line


def cmd_pipeline(args) -> int:
    """The whole pipeline from a config; prints the stage table."""
    import time

    from ..pipeline import format_summary, run_full_pipeline

    t0 = time.time()
    cfg = load_config(args.config)
    summary = run_full_pipeline(cfg, data_override=getattr(args, "data", None))
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
    pl.add_argument("--results", help="also write the summary to this docs/results JSON file")
    pl.set_defaults(func=cmd_pipeline)


def add_demo(sub) -> None:
    d = sub.add_parser("demo", help="run the main job on the embedded synthetic default")
    d.add_argument("--config", default="configs/demo.yaml")
    d.set_defaults(func=cmd_demo)
