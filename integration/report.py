"""`dgr2 report`: assemble docs/results files from `dgr2 eval` reports already written.

Evaluating a model on the Beauty test users takes minutes on this CPU, so each model is evaluated
once (`dgr2 eval --out`) and the comparisons are made afterwards from the per-user target ranks the
reports keep. Every comparison is a paired bootstrap over the same users; a report from other users
(different count or data) is refused rather than compared.

* `ar`: the AR re-ranker's report (docs/results/rerank-ar-<name>.json) with its CIs against every
  non-LM baseline of the data (recomputed from the data dir, same users), the copy-order rate
  before the last stage, and the wall-clock of each training stage.
* `stages`: the stage table (docs/results/stages-<name>.json), each row with its CI against the
  reference row (the AR teacher) and its decode speed-up over it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from candidate_gen.files import read_jsonl
from reranker.eval.metrics import compare, summarize
from reranker.stages.base import read_done

ROW_KEYS = ("n", "decoder", "tau", "block_size", "batch_size", "recall@1", "recall@3", "ndcg@3", "ndcg@5",
            "valid_rate", "fallback_rate", "copy_order_rate", "failures", "mean_generated_tokens",
            "tokens_per_second", "forward_passes_per_token", "vs_retriever", "model", "command", "commit")


def load_report(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such eval report (write one with `dgr2 eval ... --out {path}`)")
    try:
        rep = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(rep.get("ranks"), list):
        raise ValueError(f"{path}: field 'ranks' missing: not a `dgr2 eval` report")
    rep["_path"] = str(path)
    return rep


def _same_users(reports: list[dict]) -> None:
    first = reports[0]
    for r in reports[1:]:
        for key in ("n", "split"):
            if r.get(key) != first.get(key):
                raise ValueError(f"{r['_path']}: {key} {r.get(key)!r} differs from {first['_path']} "
                                 f"({first.get(key)!r}); paired comparisons need the same test users")


def stage_seconds(stage_dirs: dict[str, str]) -> dict[str, float | None]:
    """Wall-clock of each finished stage, from the stage_done.json its output directory holds."""
    out = {}
    for name, d in stage_dirs.items():
        done = read_done(d)
        if done is None:
            raise FileNotFoundError(f"{d}: no finished stage there (stage_done.json missing)")
        out[name] = done.get("wall_seconds")
    return out


def ar_report(final: dict, data_dir, before: dict | None = None, stage_dirs: dict[str, str] | None = None,
              n_boot: int = 2000, seed: int = 0) -> dict:
    """The final AR eval report plus CIs against every baseline of the data on the same users."""
    from reranker.eval.baselines import baseline_ranks

    ranks = np.asarray(final["ranks"])
    base = baseline_ranks(data_dir, seed=seed)
    n_base = len(next(iter(base.values())))
    if n_base != len(ranks):
        raise ValueError(f"{final['_path']}: {len(ranks)} users, but {data_dir}/test.jsonl has {n_base}: "
                         "evaluate the whole test split (no --limit) to compare with the baselines")
    rep = {k: v for k, v in final.items() if k not in ("_path", "command", "commit", "date")}
    # The eval's own provenance stays next to the report's (which write_result records).
    rep.update({f"eval_{k}": final.get(k) for k in ("command", "commit", "date") if final.get(k)})
    rep["baselines"] = {name: summarize(r) for name, r in base.items()}
    rep["vs_baselines"] = {name: compare(r, ranks, n_boot=n_boot, seed=seed) for name, r in base.items()}
    if before is not None:
        _same_users([final, before])
        rep["before_last_stage"] = {k: before.get(k) for k in ROW_KEYS if k in before}
        rep["before_last_stage"]["vs_retriever"] = before.get("vs_retriever")
        rep["vs_before_last_stage"] = compare(np.asarray(before["ranks"]), ranks, n_boot=n_boot, seed=seed)
    if stage_dirs:
        rep["stage_seconds"] = stage_seconds(stage_dirs)
    return rep


def stages_report(rows: list[tuple[str, dict]], reference: str = "AR GR2",
                  ablations: list[tuple[str, dict]] | None = None, n_boot: int = 2000, seed: int = 0) -> dict:
    """The stage table: a retriever row, then every (label, report) with CIs against `reference`."""
    ablations = ablations or []
    reports = [r for _, r in rows + ablations]
    if not reports:
        raise ValueError("no rows given")
    _same_users(reports)
    ref = next((r for label, r in rows if label == reference), None)
    if ref is None:
        raise ValueError(f"reference row {reference!r} is not among the rows: {[label for label, _ in rows]}")
    ref_ranks, ref_tps = np.asarray(ref["ranks"]), ref.get("tokens_per_second")

    def row(label, r):
        out = {"name": label, **{k: r.get(k) for k in ROW_KEYS if k in r}}
        if label != reference:
            out["vs_ar"] = compare(ref_ranks, np.asarray(r["ranks"]), n_boot=n_boot, seed=seed)
        out["speedup_vs_ar"] = r["tokens_per_second"] / ref_tps if ref_tps else None
        return out

    first = reports[0]
    return {"test_users": first.get("n"), "split": first.get("split"), "reference": reference,
            "tau": next((r.get("tau") for _, r in rows if r.get("decoder") == "diffusion"), None),
            "block_size": next((r.get("block_size") for _, r in rows if r.get("decoder") == "diffusion"), None),
            "rows": [{"name": "retriever order", **first["retriever"]}] + [row(lab, r) for lab, r in rows],
            "ablations": [row(lab, r) for lab, r in ablations]}


def parse_pairs(items: list[str], what: str) -> list[tuple[str, str]]:
    """["LABEL=PATH", ...] -> [(label, path)], with an error naming the bad item."""
    out = []
    for it in items or []:
        label, sep, path = it.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"{what} {it!r}: expected LABEL=PATH")
        out.append((label, path))
    return out


# Bookkeeping columns of metrics.jsonl that are not learning curves.
_NOT_CURVES = {"step", "kind", "epoch", "lr", "tokens", "optimizer_step", "rollout_seconds", "update_seconds"}


def training_curves(runs: list[tuple[str, str]]) -> dict:
    """{"runs": {label: {"train": {metric: [[step, value], ...]}, "valid": {...}}}} from each run
    directory's metrics.jsonl (written by reranker.training.logging.RunLogger)."""
    out = {}
    for label, run_dir in runs:
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no metrics log (a stage's run dir holds one: <runs>/<stage>)")
        curves: dict[str, dict[str, list]] = {"train": {}, "valid": {}}
        for row in read_jsonl(path):
            if row.get("kind") not in curves:
                continue
            for k, v in row.items():
                if k not in _NOT_CURVES and isinstance(v, (int, float)) and not isinstance(v, bool):
                    curves[row["kind"]].setdefault(k, []).append([row.get("step"), v])
        out[label] = curves
    return {"runs": out}
