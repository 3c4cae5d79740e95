"""`dgr2 bench`: rebuild docs/BENCHMARKS.md and docs/plots/*.png from docs/results/*.json only.

Never from cached or typed-in numbers: every cell comes from a result file, every table names the
command, commit and date recorded in that file (``candidate_gen.files.write_result`` adds them;
a file without them says "not recorded"). A section whose files are missing says "not measured
yet" and which command produces them. A file that does not match its schema is reported in place
(with the error) rather than stopping the whole report.

Sections follow the data flow (retrieval → re-ranking data → AR teacher → conversion, CFT, OPD,
RL → decoding speed → service → end to end), each matched by file-name prefix
(``<prefix><name>.json``, e.g. ``stages-beauty.json``); the JSON schema each one expects is in its
renderer's docstring. Renderers are lenient: optional keys may be missing (shown as "–"), only the
keys called *required* must be there.

    retrieval-*            retrieval_section
    rerank-baselines-*     baselines_section
    rerank-ar-*            eval_section (a `dgr2 eval` report)
    sid-copy-*             sid_copy_section
    diffusion-cft-*        eval_section
    stages-*               stages_section
    curves-*               curves_section
    train-cost-*           train_cost_section
    diffusion-speed-*      speed_section, frontier_section, length_batch_section
    forward-cost-*         forward_cost_section
    service-load*          service_section
    service-overload*      overload_section
    recbole-e2e-*          recbole_section

``docs/results/*.json`` holds one current file per result. A run that a later run of the same
measurement replaced moves to ``docs/results/archive/``; those files are rendered, in the order
they were made, on their own page beside them (``docs/results/archive/BENCHMARKS.md``, plots in
its ``plots/``), which the main page links at its end.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from candidate_gen.files import RESULTS_DIR, atomic_write_text, read_results

from . import plots

log = logging.getLogger(__name__)

METRICS = ("recall@1", "recall@3", "ndcg@3", "ndcg@5")
LABELS = {"recall@1": "R@1", "recall@3": "R@3", "ndcg@3": "NDCG@3", "ndcg@5": "NDCG@5", "recall@10": "Recall@10",
          "ndcg@10": "NDCG@10", "valid_rate": "valid rate", "tokens_per_second": "tok/s"}


# ------------------------------------------------------------------------------------------- helpers

def _fmt(v, digits=4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _ci(d) -> str:
    """'+0.0123 [+0.0050, +0.0200]' from {"diff", "ci_low", "ci_high"}; '' when absent."""
    if not isinstance(d, dict) or d.get("diff") is None:
        return ""
    if d.get("ci_low") is None or d.get("ci_high") is None:
        return f"{d['diff']:+.4f}"
    return f"{d['diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]"


def _cell(value, ci=None) -> str:
    c = _ci(ci)
    return f"{_fmt(value)} ({c})" if c else _fmt(value)


def _get(row: dict, key: str):
    """row[key], or row["metrics"][key] (producers nest metrics either way)."""
    if key in row:
        return row[key]
    m = row.get("metrics")
    return m.get(key) if isinstance(m, dict) else None


def _med(s):
    return s.get("median") if isinstance(s, dict) else s


def _stat(s, digits=1) -> str:
    """'median [min–max]' of a reranker.eval.speed.stats dict (or a bare number)."""
    if isinstance(s, dict):
        if s.get("median") is None:
            return "–"
        if s.get("min") is None or s.get("max") is None:
            return f"{s['median']:.{digits}f}"
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"
    return "–" if s is None else f"{s:.{digits}f}"


def provenance(r: dict) -> str:
    cmd = r.get("command")
    cmd = f"`{cmd}`" if cmd else "not recorded"
    line = f"Command: {cmd} (commit `{r.get('commit') or 'not recorded'}`, {r.get('date') or 'date not recorded'})."
    if r.get("eval_command"):  # a `dgr2 report` file: the evaluation it was assembled from
        line += f" Evaluated by `{r['eval_command']}` (commit `{r.get('eval_commit') or 'not recorded'}`)."
    # A result file's "note" (e.g. a budget choice behind its numbers) travels with its provenance.
    return line + (f" Note: {r['note']}" if r.get("note") else "")


def _name(stem: str, prefix: str) -> str:
    n = stem[len(prefix):].lstrip("-") if stem.startswith(prefix) else ""  # "service-load-<date>": "<date>"
    return n or stem


@dataclass
class Ctx:
    """What a renderer may need besides its document: where plots go and how the page links them."""
    plots_dir: Path
    page_dir: Path

    def image(self, path: Path | None, alt: str) -> list[str]:
        if path is None:
            return []
        return [f"![{alt}]({Path(os.path.relpath(path, self.page_dir)).as_posix()})", ""]


# ----------------------------------------------------------------------------------------- renderers

def retrieval_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """`dgr2 retrieve --results docs/results/retrieval-<name>.json` (candidate_gen.retrieve).

    Schema: {"dataset", "users", "items", "interactions", "recall@10", "ndcg@10", "recall@10_masked",
    "ndcg@10_masked", "recall@50_masked", "faiss_recbole_top10_agreement", "hnsw_recall@10",
    "test_users_target_in_top10", "train_hit_rate_in_sample", "train_hit_rate_crossfit",
    "valid_hit_rate", "train_seconds", "wall_seconds", "folds": [{"fold", "users", "positions",
    "hit_rate", "train_seconds"}]} — all optional.
    """
    rows = [
        ("Recall@10 (RecBole standard, full sort)", "recall@10"),
        ("NDCG@10 (RecBole standard, full sort)", "ndcg@10"),
        ("Recall@10, history masked", "recall@10_masked"),
        ("NDCG@10, history masked", "ndcg@10_masked"),
        ("Recall@50, history masked", "recall@50_masked"),
        ("FAISS exact top-10 = RecBole full-sort top-10 (masked), share of test users",
         "faiss_recbole_top10_agreement"),
        ("HNSW recall@10 against exact", "hnsw_recall@10"),
        ("test users with target in masked top-10", "test_users_target_in_top10"),
        ("target-in-top-10, training positions, in-sample retriever", "train_hit_rate_in_sample"),
        ("target-in-top-10, training positions, cross-fitted retrievers", "train_hit_rate_crossfit"),
        ("target-in-top-10, validation position", "valid_hit_rate"),
        ("SASRec training seconds (main + folds)", "train_seconds"),
        ("wall seconds, whole command", "wall_seconds"),
    ]
    out = [f"### {r.get('dataset', name)} (`{name}.json`)", "",
           f"{_fmt(r.get('users'))} users, {_fmt(r.get('items'))} items, {_fmt(r.get('interactions'))} interactions. "
           + provenance(r), ""]
    if r.get("hnsw_remeasured_by"):
        out += [f"HNSW recall re-measured on the saved model after an index change (was "
                f"{_fmt(r.get('hnsw_recall@10_before_remeasure'))}): `{r['hnsw_remeasured_by']}`.", ""]
    out += ["| metric | value |", "|---|---|"]
    out += [f"| {label} | {_fmt(r.get(key))} |" for label, key in rows]
    if r.get("folds"):
        out += ["", "| fold | held-out users | training positions | target in top-10 | SASRec seconds |",
                "|---|---|---|---|---|"]
        out += [f"| {f.get('fold')} | {_fmt(f.get('users'))} | {_fmt(f.get('positions'))} | {_fmt(f.get('hit_rate'))} | "
                f"{_fmt(f.get('train_seconds'), 0)} |" for f in r["folds"]]
    return out + [""]


def baselines_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/rerank-baselines-<name>.json (reranker.eval.baselines.run_baselines).

    Schema: {"test_users" (or "split" and "users"), "n_candidates", "n_boot", "methods" (required):
    {<method>: {"metrics": {"recall@1", "recall@3", "ndcg@3", "ndcg@5"}, "vs_retriever": {<metric>:
    {"diff", "ci_low", "ci_high"}} | null}}}. Cells: value (difference vs the retriever order [95%
    paired bootstrap CI]).
    """
    users = (f"{_fmt(r.get('test_users'))} test users" if "test_users" in r else
             f"{_fmt(r.get('users'))} {r.get('split', '?')} lists")
    out = [f"### {name}", "", f"{users}, {_fmt(r.get('n_candidates'))} candidates "
           f"each; value (difference vs retriever [95% CI]). " + provenance(r), "",
           "| method | " + " | ".join(LABELS[m] for m in METRICS) + " |", "|---|" + "---|" * len(METRICS)]
    for method, m in r["methods"].items():
        vs = m.get("vs_retriever") or {}
        out.append(f"| {method} | " + " | ".join(_cell(_get(m, k), vs.get(k)) for k in METRICS) + " |")
    return out + [""]


def eval_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """A `dgr2 eval --out ...` report (reranker.eval.evaluate.evaluate): rerank-ar-<name>.json,
    diffusion-cft-<name>.json.

    Schema: {"n", "decoder", "tau", "block_size", "split", "recall@1", "recall@3", "ndcg@3",
    "ndcg@5" (required: at least one), "retriever": {<metric>}, "vs_retriever": {<metric>: {"diff",
    "ci_low", "ci_high"}}, "valid_rate", "fallback_rate", "copy_order_rate", "failures": {<kind>: n},
    "mean_generated_tokens", "tokens_per_second", "forward_passes_per_token",
    optional "vs_baselines": {<baseline>: {<metric>: {"diff", "ci_low", "ci_high"}}},
    optional "stage_seconds": {<stage>: seconds} (wall-clock of each training stage),
    optional "before_last_stage": {<metric>, "valid_rate", "copy_order_rate"} and
    "vs_before_last_stage": {<metric>: {...}} (`dgr2 report ar --before`)}.
    """
    dec = r.get("decoder", "?")
    extra = f", τ = {r['tau']}, block size {r.get('block_size') or 'from model'}" if dec == "diffusion" else ""
    out = [f"### {name} ({dec}{extra})", "",
           f"{_fmt(r.get('n'))} {r.get('split', 'test')} users. " + provenance(r), "",
           "| metric | retriever | model | difference [95% CI] |", "|---|---|---|---|"]
    ret, vs = r.get("retriever") or {}, r.get("vs_retriever") or {}
    for k in METRICS:
        if _get(r, k) is not None:
            out.append(f"| {LABELS[k]} | {_fmt(ret.get(k))} | {_fmt(_get(r, k))} | {_ci(vs.get(k)) or '–'} |")
    out += ["", f"Valid-output rate {_fmt(r.get('valid_rate'))}, fallback rate {_fmt(r.get('fallback_rate'))}, "
                f"copy-the-input-order rate {_fmt(r.get('copy_order_rate'))}; "
                f"{_fmt(r.get('mean_generated_tokens'), 1)} generated tokens per answer, "
                f"{_fmt(r.get('tokens_per_second'), 1)} tok/s, "
                f"{_fmt(r.get('forward_passes_per_token'), 3)} forward passes per token."]
    b4 = r.get("before_last_stage")
    if b4:
        vs = (r.get("vs_before_last_stage") or {}).get("recall@1")
        out.append(f"Before the last training stage: R@1 {_fmt(b4.get('recall@1'))}, valid-output rate "
                   f"{_fmt(b4.get('valid_rate'))}, copy-the-input-order rate {_fmt(b4.get('copy_order_rate'))}"
                   + (f"; the last stage changed R@1 by {_ci(vs)}." if vs else "."))
    if r.get("failures"):
        out.append("Failures: " + ", ".join(f"{k} {v}" for k, v in r["failures"].items()) + ".")
    if r.get("vs_baselines"):
        bases = r.get("baselines") or {}
        out += ["", "Model minus each baseline on the same users (baseline value in brackets):", "",
                "| vs baseline | " + " | ".join(LABELS[m] for m in METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        for b, d in r["vs_baselines"].items():
            val = bases.get(b) or {}
            out.append(f"| {b} | " + " | ".join((_ci(d.get(k)) or "–") + (f" ({_fmt(val[k])})" if k in val else "")
                                              for k in METRICS) + " |")
    if r.get("stage_seconds"):
        out += ["", "| training stage | wall seconds |", "|---|---|"]
        out += [f"| {s} | {_fmt(v, 0)} |" for s, v in r["stage_seconds"].items()]
    return out + [""]


STAGE_COLS = ("recall@1", "recall@3", "ndcg@3")


def stages_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/stages-<name>.json: the paper's stage table on the same test users.

    Schema: {"test_users", "tau", "block_size", "rows" (required): [{"name" (required; e.g.
    "retriever", "AR GR2", "naive conversion", "+CFT", "+CFT+OPD", "+CFT+OPD+RL"), "decoder",
    "recall@1", "recall@3", "ndcg@3", "valid_rate", "tokens_per_second", "speedup_vs_ar",
    "vs_ar": {<metric>: {"diff", "ci_low", "ci_high"}}, "vs_retriever": {...}, "command", "commit"}],
    optional "ablations": [rows in the same format]}. Metric keys may also sit under "metrics".
    Cells: value (difference vs AR [95% paired bootstrap CI]).
    """
    def table(rows):
        t = ["| stage | " + " | ".join(LABELS[m] for m in STAGE_COLS) + " | valid rate | tok/s | speed-up vs AR |",
             "|---|" + "---|" * (len(STAGE_COLS) + 3)]
        for row in rows:
            vs = row.get("vs_ar") or {}
            t.append(f"| {row.get('name', '?')} | " + " | ".join(_cell(_get(row, k), vs.get(k)) for k in STAGE_COLS)
                     + f" | {_cell(_get(row, 'valid_rate'), vs.get('valid_rate'))} | "
                       f"{_fmt(_get(row, 'tokens_per_second'), 1)} | {_fmt(_get(row, 'speedup_vs_ar'), 2)} |")
        return t

    out = [f"### {name}", "", f"{_fmt(r.get('test_users'))} test users, τ = {r.get('tau', '–')}, block size "
           f"{_fmt(r.get('block_size'))}; value (difference vs AR GR2 [95% paired bootstrap CI]). " + provenance(r), ""]
    out += table(r["rows"])
    if r.get("ablations"):
        out += ["", "Ablations:", ""] + table(r["ablations"])
    return out + [""]


def pipeline_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/pipeline-<name>.json (`dgr2 pipeline --record`): what the run cost.

    Schema: {"stage_seconds" (required): {step: seconds}, "total_seconds", "resumed",
    "invocations": [{"commit", "argv", "started", "finished", "seconds", "loadavg_start"}],
    "machine": {"cpu_count", "torch_version", ...}}.
    """
    calls = r.get("invocations") or []
    commits = list(dict.fromkeys(str(c.get("commit")) for c in calls if c.get("commit")))
    m = r.get("machine") or {}
    hours = (r.get("total_seconds") or 0) / 3600
    head = (f"Total {_fmt(r.get('total_seconds'), 0)} s ({hours:.1f} h) of recorded steps over {len(calls)} "
            "call(s) of the command" + (" (resumed)" if r.get("resumed") else "")
            + (f", at commit {', '.join(f'`{c}`' for c in commits)}" if commits else "")
            + f"; {_fmt(m.get('cpu_count'))} CPUs, torch {m.get('torch_version', '?')}. " + provenance(r))
    out = [f"### {name}", "", head, "",
           "| step | seconds |", "|---|---|"]
    out += [f"| {k} | {_fmt(v, 0) if isinstance(v, (int, float)) else '–'} |" for k, v in r["stage_seconds"].items()]
    return out + [""]


def _speed_intro(r: dict) -> str:
    m, s = r.get("machine") or {}, r.get("settings") or {}
    return (f"{_fmt(s.get('n_prompts'))} prompts (mean {_fmt(s.get('mean_prompt_tokens'), 0)} tokens), block size "
            f"{_fmt(s.get('block_size'))}, greedy, max {_fmt(s.get('max_new_tokens'))} new tokens; median [min–max] of "
            f"{_fmt(s.get('repeats'))} repeats after {_fmt(s.get('warmup'))} warm-up, AR and diffusion interleaved in one "
            f"process. Machine: {_fmt(m.get('cpu_count'))} CPUs, torch {m.get('torch_version', '?')} with "
            f"{_fmt(m.get('torch_threads'))} threads; load average {m.get('load_average_start', '?')} at start, "
            f"{m.get('load_average_end', '?')} at end (shared machine: spreads matter). " + provenance(r))


def speed_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/diffusion-speed-<name>.json (reranker.eval.speed.run_speed_benchmark, `dgr2 speed`).

    Schema (a "stats" is {"median", "min", "max", "q1", "q3", "n", "values"}):
    {"machine": {"cpu_count", "torch_threads", "torch_version", "load_average_start",
    "load_average_end"}, "settings": {"block_size", "max_new_tokens", "repeats", "warmup", "n_prompts",
    "mean_prompt_tokens", "taus", "batch_sizes", "lengths"},
    "batches" (required): [{"batch_size", "ar": {"tokens_per_second": stats, "forward_passes_per_token",
    "mean_generated_tokens", "recall@1", "valid_rate"}, "points": [{"tau", "tokens_per_second": stats,
    "forward_passes_per_token", "tokens_per_step", "mean_generated_tokens", "speedup" (ratio of medians),
    "speedup_paired": stats (per-repeat ratios), "decode_speedup_paired": stats (the same without the
    prompt prefill; files before it lack it), "same_tokens_as_ar", "recall@1", "valid_rate",
    "lookup_drafts" (files before it lack it: false)}],
    "exact_decoders" (files before it lack it): [{"decoder" (hf_generate | ar_lookup), the fields of a
    point but "tau" and "tokens_per_step", "tokens_per_forward", "matches_ar"}],
    "ar_compute_dtype" (files before it lack it; null when the diffusion matmuls are float32): AR with the
    diffusion's matmul precision, {"compute_dtype", the fields of an exact decoder but "matches_ar"}; each
    point then has "speedup_vs_ar_compute_dtype": stats}],
    "length_curve": [{"length", "batch_size", "ar": {...}, "points": [...]}],
    "forward_cost": {"context", "rows": [{"batch_size", "one_token_ms": stats, "blocks": [{"block_size",
    "ms": stats, "ratio"}]}]} | null,
    "accuracy": {"n", "split", "ar": {...}, "diffusion": [{"tau", "lookup_drafts", "recall@1", "valid_rate", "vs_ar":
    {"recall@1": {"diff", "ci_low", "ci_high"}}}]} | null}
    """
    out = [f"### {name}", "", _speed_intro(r), ""]
    acc = {(p.get("tau"), bool(p.get("lookup_drafts"))): p for p in ((r.get("accuracy") or {}).get("diffusion") or [])}
    out += ["| batch | decoder | tok/s | forward passes / token | tokens / step | generated tokens / row | "
            "speed-up (ratio of medians) | speed-up per repeat | decode phase (no prefill), per repeat | R@1 | "
            "R@1 vs AR [95% CI] | valid rate |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["batches"]:
        ar, b = row.get("ar") or {}, row.get("batch_size")
        out.append(f"| {b} | AR | {_stat(ar.get('tokens_per_second'))} | {_fmt(ar.get('forward_passes_per_token'), 3)} "
                   f"| 1 | {_fmt(ar.get('mean_generated_tokens'), 1)} | 1 | 1 | 1 | {_fmt(ar.get('recall@1'))} | – | "
                   f"{_fmt(ar.get('valid_rate'))} |")
        for p in row.get("exact_decoders") or []:  # tokens / step: tokens per forward pass of a row
            same = "AR's tokens" if p.get("matches_ar") else f"NOT AR's tokens ({_fmt(p.get('same_tokens_as_ar'), 2)})"
            out.append(f"| {b} | {p.get('decoder')} | {_stat(p.get('tokens_per_second'))} | "
                       f"{_fmt(p.get('forward_passes_per_token'), 3)} | {_fmt(p.get('tokens_per_forward'), 2)} | "
                       f"{_fmt(p.get('mean_generated_tokens'), 1)} | {_fmt(p.get('speedup'), 2)} | "
                       f"{_stat(p.get('speedup_paired'), 2)} | {_stat(p.get('decode_speedup_paired'), 2)} | "
                       f"{_fmt(p.get('recall@1'))} | {same} | {_fmt(p.get('valid_rate'))} |")
        low = row.get("ar_compute_dtype")
        if low:  # AR in the diffusion's matmul precision, against float32 AR (files before it lack it)
            out.append(f"| {b} | AR, {low.get('compute_dtype')} matmuls | {_stat(low.get('tokens_per_second'))} | "
                       f"{_fmt(low.get('forward_passes_per_token'), 3)} | 1 | "
                       f"{_fmt(low.get('mean_generated_tokens'), 1)} | {_fmt(low.get('speedup'), 2)} | "
                       f"{_stat(low.get('speedup_paired'), 2)} | "
                       f"{_stat(low.get('decode_speedup_paired'), 2)} | – | AR's tokens in "
                       f"{_fmt(low.get('same_tokens_as_ar'), 2)} of rows | – |")
        settings = r.get("settings") or {}
        sched = settings.get("schedule", "lockstep")
        sched = "" if sched == "lockstep" else f", {sched} rows"
        if settings.get("compute_dtype", "float32") != "float32":
            sched += f", {settings['compute_dtype']} matmuls"
        for p in row.get("points") or []:
            vs = ((acc.get((p.get("tau"), bool(p.get("lookup_drafts")))) or {}).get("vs_ar") or {}).get("recall@1")
            drafts = ", lookup drafts" if p.get("lookup_drafts") else ""
            out.append(f"| {b} | diffusion τ={_fmt(p.get('tau'), 2)}{sched}{drafts} | "
                       f"{_stat(p.get('tokens_per_second'))} | "
                       f"{_fmt(p.get('forward_passes_per_token'), 3)} | {_fmt(p.get('tokens_per_step'), 2)} | "
                       f"{_fmt(p.get('mean_generated_tokens'), 1)} | {_fmt(p.get('speedup'), 2)} | "
                       f"{_stat(p.get('speedup_paired'), 2)} | {_stat(p.get('decode_speedup_paired'), 2)} | "
                       f"{_fmt(p.get('recall@1'))} | {_ci(vs) or '–'} | "
                       f"{_fmt(p.get('valid_rate'))} |")
    lows = [(row.get("batch_size"), p) for row in r["batches"] if row.get("ar_compute_dtype")
            for p in row.get("points") or []]
    if lows:
        dtype = r["batches"][0]["ar_compute_dtype"].get("compute_dtype")
        out += ["", f"Diffusion against AR with {dtype} matmuls too (per repeat, median [min–max]): "
                + "; ".join(f"batch {b} τ={_fmt(p.get('tau'), 2)}: {_stat(p.get('speedup_vs_ar_compute_dtype'), 2)}"
                            for b, p in lows) + "."]
    if not r.get("accuracy"):
        out += ["", "Accuracy per τ: not measured in this file (`dgr2 speed` with `--data` measures it)."]
    else:
        a = r["accuracy"]
        out += ["", f"Accuracy: `reranker.eval.evaluate` on {_fmt(a.get('n'))} {a.get('split', 'test')} users per point "
                    "(greedy; batch size does not change the answers)."]
        if a.get("timed_prompts"):  # files before it lack it
            pts = "; ".join(f"diffusion τ={_fmt(p.get('tau'), 2)}"
                            f"{', lookup drafts' if p.get('lookup_drafts') else ''} "
                            f"{_fmt(p.get('timed_valid_rate'), 3)} ({_fmt(p.get('valid_rate'), 3)})"
                            for p in a.get("diffusion") or [])
            out += ["", f"Valid rate on the {_fmt(a['timed_prompts'])} timed prompts (on all {_fmt(a.get('n'))} "
                        f"accuracy users): AR {_fmt((a.get('ar') or {}).get('timed_valid_rate'), 3)} "
                        f"({_fmt((a.get('ar') or {}).get('valid_rate'), 3)}); {pts}. A wrong diffusion answer is a "
                        "slow one: a timed sample with more of them than the whole understates diffusion's speed."]
    fc = r.get("forward_cost")
    if fc and fc.get("rows"):
        sizes = [b.get("block_size") for b in fc["rows"][0].get("blocks") or []]
        out += ["", f"Cost of one forward pass against a KV cache of {_fmt(fc.get('context'))} columns, relative to a "
                    f"one-token step (median of {_fmt(fc.get('iters'))} interleaved iterations):", "",
                "| batch | one-token step (ms) | " + " | ".join(f"block of {s}" for s in sizes) + " |",
                "|---|---|" + "---|" * len(sizes)]
        for row in fc["rows"]:
            out.append(f"| {row.get('batch_size')} | {_stat(row.get('one_token_ms'), 2)} | "
                       + " | ".join(f"{_fmt(b.get('ratio'), 2)}× ({_stat(b.get('ms'), 2)} ms)"
                                    for b in row.get("blocks") or []) + " |")
    return out + [""]


def forward_cost_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/forward-cost-<name>.json (reranker.eval.speed.run_forward_cost, `dgr2 forward-cost`).

    Schema: {"machine": {...}, "settings": {"context", "length", "model", "model_parameters"},
    "forward_cost": {"context", "iters", "rows": [{"batch_size", "one_token_ms": stats, "blocks":
    [{"block_size", "ms": stats, "ratio", "fused_ms": stats, "fused_ratio"}]}]},
    "ceiling": {"length", "steps_per_block", "rows": [{"batch_size", "blocks": [{"block_size",
    "steps_per_block", "ceiling"}]}], "concurrency": [{"max_batch", "steps_per_block", "ceiling",
    "ar_batch", "diffusion_batch", "block_size"}]}}
    """
    m, s, fc, ceil = r.get("machine") or {}, r.get("settings") or {}, r["forward_cost"], r["ceiling"]
    sizes = [b.get("block_size") for b in fc["rows"][0].get("blocks") or []]
    steps = ceil.get("steps_per_block") or [1]
    cell = {(x["batch_size"], b["block_size"], b["steps_per_block"]): b["ceiling"] for x in ceil["rows"]
            for b in x["blocks"]}
    out = [f"### {name}", "",
           f"One forward against a KV cache of {_fmt(fc.get('context'))} columns ({s.get('model', '?')}, "
           f"{_fmt(s.get('model_parameters'))} parameters), median of {_fmt(fc.get('iters'))} interleaved iterations, "
           f"{_fmt(m.get('torch_threads'))} torch threads on {_fmt(m.get('cpu_count'))} CPUs, load average "
           f"{m.get('load_average_start', '?')} → {m.get('load_average_end', '?')}. Each cell: a B-column block step / "
           "the fused 2B-column step (the previous block's clean write in the same forward), as multiples of a "
           f"one-token step, then the speed-up ceilings for a {_fmt(ceil.get('length'))}-token answer of an exact "
           "decoder whose every block takes s = " + " or ".join(str(x) for x in steps) + " steps, against AR at the "
           "same batch (τ = 0.9 on Beauty took about 2). " + provenance(r), "",
           "| batch | one-token step (ms) | " + " | ".join(f"B = {b}: step / fused → ceiling s = "
                                                         + " / ".join(str(x) for x in steps) for b in sizes) + " |",
           "|---|---|" + "---|" * len(sizes)]
    for row in fc["rows"]:
        b = row.get("batch_size")
        out.append(f"| {b} | {_stat(row.get('one_token_ms'), 2)} | " + " | ".join(
            f"{_fmt(x.get('ratio'), 2)}× / {_fmt(x.get('fused_ratio'), 2)}× → **"
            + " / ".join(f"{_fmt(cell.get((b, x['block_size'], st)), 2)}×" for st in steps) + "**"
            for x in row.get("blocks") or []) + " |")
    out += ["", "Best ceiling when a micro-batcher may batch up to c requests (the best diffusion batch ≤ c and "
                "block size against the best AR batch ≤ c):", "",
            "| c | steps per block | ceiling | diffusion batch, B | AR batch |", "|---|---|---|---|---|"]
    for c in ceil.get("concurrency") or []:
        out.append(f"| {c['max_batch']} | {c.get('steps_per_block', 1)} | {_fmt(c['ceiling'], 2)}× | "
                   f"{c['diffusion_batch']}, {c['block_size']} | {c['ar_batch']} |")
    return out + [""]


def train_cost_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/train-cost-<name>.json (reranker.eval.speed.training_step_cost, `dgr2 train-cost`).

    Schema: {"model", "machine": {...}, "batch_size", "length", "iters", "rows": [{"autocast",
    "seconds": stats}], "speedup"}
    """
    m = r.get("machine") or {}
    out = [f"### {name}", "",
           f"One optimizer step (forward, backward, AdamW) of {r.get('model', '?')} on {_fmt(r.get('batch_size'))} "
           f"sequences of {_fmt(r.get('length'))} tokens, settings interleaved per iteration, median [min–max] of "
           f"{_fmt(r.get('iters'))}; {_fmt(m.get('torch_threads'))} torch threads on {_fmt(m.get('cpu_count'))} CPUs. "
           + provenance(r), "", "| autocast | seconds per step |", "|---|---|"]
    out += [f"| {x['autocast']} | {_stat(x.get('seconds'), 3)} |" for x in r.get("rows") or []]
    return out + ["", f"Speed-up of the last setting: **{_fmt(r.get('speedup'), 2)}×**.", ""]


def frontier_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """The τ frontier from diffusion-speed-<name>.json: Recall@1 vs decode tok/s, one point per τ and
    batch size, AR as reference. Needs "accuracy" in the file (see speed_section's schema)."""
    out = [f"### {name}", "", provenance(r), ""]
    rows = [(row, p) for row in r.get("batches") or [] for p in row.get("points") or []]
    if not any(p.get("recall@1") is not None for _, p in rows):
        return out + ["Not measured yet: this speed file has no accuracy per τ (run `dgr2 speed` with `--data`).", ""]
    out += ["| batch | τ | tok/s | speed-up | R@1 | valid rate |", "|---|---|---|---|---|---|"]
    for row in r["batches"]:
        ar = row.get("ar") or {}
        out.append(f"| {row.get('batch_size')} | AR | {_stat(ar.get('tokens_per_second'))} | 1 | "
                   f"{_fmt(ar.get('recall@1'))} | {_fmt(ar.get('valid_rate'))} |")
        for p in row.get("points") or []:
            out.append(f"| {row.get('batch_size')} | {_fmt(p.get('tau'), 2)} | {_stat(p.get('tokens_per_second'))} | "
                       f"{_fmt(p.get('speedup'), 2)} | {_fmt(p.get('recall@1'))} | {_fmt(p.get('valid_rate'))} |")
    out.append("")
    if ctx is not None:
        out += ctx.image(plots.plot_tau_frontier(r, ctx.plots_dir / f"tau-frontier-{name}.png",
                                                 f"τ frontier ({name})"), f"tau frontier {name}")
    return out


def length_batch_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """Speed-up vs output length (the "length_curve" of diffusion-speed-<name>.json, EOS disabled)
    and vs batch size (its "batches"). See speed_section for the schema."""
    out = [f"### {name}", "", provenance(r), ""]
    curve = r.get("length_curve") or []
    if curve:
        out += ["Both decoders generate exactly L tokens per row (EOS disabled). Tokens past the model's natural "
                "end are out of distribution for its confidence, so this measures the decoding mechanics "
                "(cost per step vs tokens per step as the cache grows), not accuracy-preserving speed.", "",
                "| L | batch | AR tok/s | τ | diffusion tok/s | tokens / step | forward passes / token | "
                "speed-up per repeat |", "|---|---|---|---|---|---|---|---|"]
        for row in curve:
            for p in row.get("points") or []:
                out.append(f"| {row.get('length')} | {row.get('batch_size')} | "
                           f"{_stat((row.get('ar') or {}).get('tokens_per_second'))} | {_fmt(p.get('tau'), 2)} | "
                           f"{_stat(p.get('tokens_per_second'))} | {_fmt(p.get('tokens_per_step'), 2)} | "
                           f"{_fmt(p.get('forward_passes_per_token'), 3)} | {_stat(p.get('speedup_paired'), 2)} |")
        out.append("")
    else:
        out += ["Speed-up vs output length: not measured in this file (`dgr2 speed --lengths 64,128,256`).", ""]
    if ctx is not None:
        out += ctx.image(plots.plot_speedup_vs_length(r, ctx.plots_dir / f"speedup-length-{name}.png",
                                                      f"Speed-up vs output length ({name})"), f"speed-up vs length {name}")
        out += ctx.image(plots.plot_speedup_vs_batch(r, ctx.plots_dir / f"speedup-batch-{name}.png",
                                                     f"Speed-up vs batch size ({name})"), f"speed-up vs batch {name}")
    return out


def service_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/service-load.json (reranker.service.loadtest, `dgr2 loadtest --out ...`).

    Schema: {"runs" (required): [{"concurrency", "options": {"decoder", ...}, "qps", "latency_ms":
    {"p50", "p95", "p99", "mean", "max"}, "ok", "errors": {<status code>: n}, "requests_sent",
    "mean_batch_size", "fallback_rate"}], "diffusion_over_ar_qps": {<concurrency>: ratio}}.
    """
    out = [f"### {name}", "", provenance(r), "",
           "| decoder | concurrency | QPS | p50 ms | p95 ms | p99 ms | ok | errors | mean batch | fallback rate |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        lat = run.get("latency_ms") or {}
        errs = ", ".join(f"{k} {v}" for k, v in (run.get("errors") or {}).items()) or "0"
        out.append(f"| {(run.get('options') or {}).get('decoder') or run.get('decoder', '?')} | {run.get('concurrency')} | "
                   f"{_fmt(run.get('qps'), 2)} | {_fmt(lat.get('p50'), 1)} | {_fmt(lat.get('p95'), 1)} | "
                   f"{_fmt(lat.get('p99'), 1)} | {_fmt(run.get('ok'))} | {errs} | {_fmt(run.get('mean_batch_size'), 2)} | "
                   f"{_fmt(run.get('fallback_rate'))} |")
    if r.get("diffusion_over_ar_qps"):
        out += ["", "Diffusion QPS ÷ AR QPS: " + ", ".join(f"concurrency {c}: {_fmt(v, 2)}×"
                                                          for c, v in r["diffusion_over_ar_qps"].items()) + "."]
    out.append("")
    if r.get("overload"):
        out += _overload_lines(r["overload"])
    if ctx is not None:
        out += ctx.image(plots.plot_service_load(r, ctx.plots_dir / f"{name}.png", f"Service load ({name})"),
                         f"service load {name}")
    return out


def _overload_lines(o: dict) -> list[str]:
    """The `overload` object of a loadtest report: per method, what came back and what a refused
    caller waited."""
    rate = o.get("rate_per_s")
    sent = f"at {rate:g} a second (open loop)" if rate else "all at once"
    out = [f"Overload: {_fmt(o.get('calls_per_method'))} calls a method, sent {sent}.", "",
           "| method | codes | refusal p50 ms | refusal p99 ms | ok p50 ms | send lag p99 ms |",
           "|---|---|---|---|---|---|"]
    for m in (o.get("refusal_p99_ms") or {}):
        d = o.get(m) or {}
        codes = ", ".join(f"{k} {v}" for k, v in (d.get("codes") or {}).items())
        cells = [_fmt((d.get(key) or {}).get(q), 1)
                 for key, q in (("refusal_ms", "p50"), ("refusal_ms", "p99"), ("ok_ms", "p50"), ("send_lag_ms", "p99"))]
        out.append(f"| {m} | {codes} | " + " | ".join(cells) + " |")
    return out + [""]


def overload_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/service-overload*.json (`dgr2 loadtest --n 0 --overload N [--overload-rate R]`).

    Schema: {"overload" (required): {"calls_per_method", "rate_per_s" (null: all at once),
    "refusal_p99_ms": {<method>: ms}, <method>: {"codes", "refusal_ms", "ok_ms", "send_lag_ms"}}}.
    """
    return [f"### {name}", "", provenance(r), ""] + _overload_lines(r["overload"])


def _users_note(r: dict) -> str:
    total, n = r.get("n_users_total"), r.get("n_users")
    if total is None or n is None or n >= total:
        return f"{_fmt(n)} test users"
    return (f"{_fmt(n)} of {_fmt(total)} test users (a random sample, seed {_fmt(r.get('user_sample_seed'))}; "
            "the same users in every row)")


def recbole_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/recbole-e2e-<name>.json: RecBole's own evaluator (full sort, same config) on
    SASRec alone vs SASRec + AR GR2 vs SASRec + Diffusion-GR2.

    Schema: {"dataset", "history_masked" (bool), "n_users", "n_users_total" and "user_sample_seed"
    (optional: n_users of n_users_total test users, a seeded random sample), "rows" (required; or
    "models": {<name>: {<metric>: value}}): [{"name" (required), "decoder", "tau", "recall@10",
    "ndcg@10", any other numeric metric, "seconds", optional "vs_sasrec": {<metric>: {"diff", "ci_low",
    "ci_high"}}}]}. Columns: recall@10 and ndcg@10 first, then every other numeric key.
    """
    rows = r.get("rows")
    if rows is None:
        rows = [{"name": k, **v} for k, v in (r.get("models") or {}).items()]
    if not rows:
        raise KeyError("rows")
    skip = {"name", "decoder", "tau", "block_size", "command", "commit"}
    keys = [k for k in ("recall@10", "ndcg@10") if any(k in x for x in rows)]
    keys += sorted({k for x in rows for k, v in x.items()
                    if k not in skip and k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool)})
    out = [f"### {r.get('dataset', name)}", "",
           f"RecBole `Trainer.evaluate`, full sort; history items masked: {_fmt(r.get('history_masked'))}; "
           f"{_users_note(r)}. " + provenance(r), "",
           "| model | " + " | ".join(LABELS.get(k, k) for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for x in rows:
        label = x.get("name", "?") + (f" (τ = {x['tau']})" if x.get("tau") is not None else "")
        vs = x.get("vs_sasrec") or {}
        out.append(f"| {label} | " + " | ".join(_cell(x.get(k), vs.get(k)) if k in vs else _fmt(x.get(k))
                                                for k in keys) + " |")
    if any(x.get("vs_sasrec") for x in rows):
        out += ["", "In brackets: the difference from SASRec alone with its paired bootstrap 95% CI over the "
                "same users."]
    return out + [""]


def curves_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/curves-<name>.json (`dgr2 report curves`): learning curves of training stages.

    Schema: {"runs" (required): {<stage label>: {"train": {<metric>: [[step, value], ...]},
    "valid": {...}}}}. The table gives each run's first and last value of every plotted metric.
    """
    runs = r["runs"]
    out = [f"### {name}", "", provenance(r), "", "| stage | metric | first | last | points |", "|---|---|---|---|---|"]
    for label, c in runs.items():
        for kind in ("train", "valid"):
            for m in plots.CURVE_METRICS:
                pts = (c.get(kind) or {}).get(m)
                if pts:
                    out.append(f"| {label} ({kind}) | {m} | {_fmt(pts[0][1])} | {_fmt(pts[-1][1])} | {len(pts)} |")
    out.append("")
    if ctx is not None:
        out += ctx.image(plots.plot_training_curves(r, ctx.plots_dir / f"curves-{name}.png",
                                                    f"Training curves ({name})"), f"training curves {name}")
    return out


def sid_copy_section(name: str, r: dict, ctx: Ctx | None = None) -> list[str]:
    """docs/results/sid-copy-<name>.json (`dgr2 sid-copy`): can the model copy SIDs?

    Schema: {"rows" (required): [{"model", "file", "examples", "by_level": {<level>: accuracy},
    optional "by_prefix": {<level>: {"shared"|"unique": {"accuracy", "tokens"}}}, optional "errors":
    {"other_candidate", "context", "invented"}, optional "greedy": {"valid_rate", ...}}], optional
    "commands": [...] (one per appended run)}.
    """
    cmds = r.get("commands") or []
    out = [f"### {name}", "", "Teacher-forced accuracy of each answer token, by SID level (a model that copies gets "
           "b, c and d right almost always once a is right). " + provenance(r)]
    out += [f"Also: `{c}`." for c in cmds[:-1] if c]
    levels = sorted({k for row in r["rows"] for k in row.get("by_level", {})})
    out += ["", "| model | examples from | n | " + " | ".join(levels) + " |", "|---|---|---|" + "---|" * len(levels)]
    for row in r["rows"]:
        acc = row.get("by_level", {})
        out.append(f"| `{row.get('model')}` | `{row.get('file')}` | {_fmt(row.get('examples'))} | "
                   + " | ".join(_fmt(acc.get(k), 3) for k in levels) + " |")
    detailed = [row for row in r["rows"] if row.get("by_prefix") or row.get("errors") or row.get("greedy")]
    if detailed:
        out += ["", "Where the copying fails: accuracy of each SID level when the SID's earlier levels are shared "
                "with another candidate (copying must know which candidate it is on) or unique (a plain content "
                "match finds the source), and where each wrong SID token comes from (another candidate's code: "
                "the lookup hit the wrong candidate). Greedy: the share of greedily decoded answers that are a "
                "valid permutation of the reference answer's SIDs (`--greedy`).", "",
                "| model | examples from | level: shared / unique prefix | wrong: other candidate / context / "
                "invented | greedy valid |", "|---|---|---|---|---|"]
        for row in detailed:
            split = "; ".join(f"{lvl} " + " / ".join(f"{kinds[k]['accuracy']:.3f}" if k in kinds else "–"
                                                     for k in ("shared", "unique"))
                              for lvl, kinds in sorted(row.get("by_prefix", {}).items()))
            err = row.get("errors") or {}
            greedy = row.get("greedy") or {}
            out.append(f"| `{row.get('model')}` | `{row.get('file')}` | {split} | "
                       + " / ".join(_fmt(err.get(k)) for k in ("other_candidate", "context", "invented"))
                       + f" | {_fmt(greedy.get('valid_rate'), 3)} |")
    return out + [""]


# ------------------------------------------------------------------------------------------ the page

@dataclass
class Section:
    title: str
    prefix: str
    render: Callable
    produce: str  # the command that writes the file(s)
    intro: str = ""


# One `dgr2 speed` run writes the file behind the three decode-speed sections.
_SPEED_RUN = ("dgr2 speed --ar <ar_dir> --diffusion <diff_dir> --data <data_dir> "
              "--out docs/results/diffusion-speed-<name>.json")

# In the order of the data flow: retrieval, re-ranking data, the AR teacher, conversion and the
# diffusion training stages, decoding speed, the service, RecBole end to end.
SECTIONS = [
    Section("Retrieval: SASRec (RecBole) + FAISS", "retrieval-", retrieval_section,
            "dgr2 retrieve --config configs/<name>.yaml --results docs/results/retrieval-<name>.json"),
    Section("Pipeline cost: seconds per step of one run", "pipeline-", pipeline_section,
            "dgr2 pipeline --config configs/<name>.yaml --out RUN --record docs/results/pipeline-<name>.json"),
    Section("Re-ranking baselines (no language model)", "rerank-baselines-", baselines_section,
            "dgr2 baselines --config configs/<name>.yaml --results docs/results/rerank-baselines-<name>.json"),
    Section("AR re-ranker (GR2)", "rerank-ar-", eval_section,
            "dgr2 eval --model <ar_dir> --data <data_dir> --decoder ar --out docs/results/rerank-ar-<name>.json"),
    Section("Released student, evaluated from its bundle alone", "rerank-student-", eval_section,
            "dgr2 eval --model models/<bundle>/student --data models/<bundle> "
            "--out docs/results/rerank-student-bundle-<name>.json"),
    Section("SID copying diagnostic", "sid-copy-", sid_copy_section,
            "dgr2 sid-copy --model <dir> --data <data_dir> --out docs/results/sid-copy-<name>.json"),
    Section("Diffusion re-ranker after CFT", "diffusion-cft-", eval_section,
            "dgr2 eval --model <cft_dir> --data <data_dir> --decoder diffusion --tau 0.9 --block-size 32 "
            "--out docs/results/diffusion-cft-<name>.json"),
    Section("Stage table: retriever → AR → conversion → CFT → OPD → RL", "stages-", stages_section,
            "dgr2 pipeline --config configs/<name>.yaml --results docs/results/stages-<name>.json, or "
            "dgr2 report stages --row <label>=<eval.json> ... --out docs/results/stages-<name>.json"),
    Section("Training curves (loss, KL, reward)", "curves-", curves_section,
            "dgr2 report curves --run <label>=<runs>/<stage> ... --out docs/results/curves-<name>.json"),
    Section("Training step cost: float32 vs autocast bf16", "train-cost-", train_cost_section,
            "dgr2 train-cost --size cpu --vocab 3032 --out docs/results/train-cost-<name>.json"),
    Section("Decode speed: block diffusion vs AR", "diffusion-speed-", speed_section, _SPEED_RUN),
    Section("τ frontier: Recall@1 vs decode speed", "diffusion-speed-", frontier_section, _SPEED_RUN),
    Section("Speed-up vs output length and batch size", "diffusion-speed-", length_batch_section, _SPEED_RUN),
    Section("Speed-up ceiling of exact block diffusion (forward cost)", "forward-cost-", forward_cost_section,
            "dgr2 forward-cost --size cpu --vocab 3032 --out docs/results/forward-cost-<name>.json"),
    Section("Service load (gRPC)", "service-load", service_section,
            "dgr2 loadtest --target 127.0.0.1:50051 --requests <candidates.jsonl> --n 5000 --decoders ar,diffusion "
            "--concurrency 1,8,32 --out docs/results/service-load.json"),
    Section("Service overload (gRPC)", "service-overload", overload_section,
            "dgr2 loadtest --target ar=127.0.0.1:50061 --requests <candidates.jsonl> --n 0 --decoders ar "
            "--overload 400 --overload-rate 200 --out docs/results/service-overload.json"),
    Section("RecBole end to end: SASRec alone vs + AR GR2 vs + Diffusion-GR2", "recbole-e2e-", recbole_section,
            "the RecBole end-to-end evaluation (integration/recbole_model.py) -> docs/results/recbole-e2e-<name>.json"),
]


def _matches(stem: str, prefix: str) -> bool:
    return stem.startswith(prefix) or stem == prefix.rstrip("-")


ARCHIVE = "archive"  # <results>/archive: runs that a later run of the same measurement replaced

_MACHINE = ["Development machine: 2 CPU cores, 24 GB RAM, no GPU, shared with other jobs",
            "(speed numbers carry their spread and the load average). Do not edit by hand: rerun `dgr2 bench`.", ""]


def _sections(results: dict[str, dict], ctx: Ctx, missing: bool = True) -> list[str]:
    """Every section in SECTIONS order, each file rendered in the order of `results`; a section without
    files says "not measured yet" (or is left out when not `missing`), unmatched files are listed."""
    lines, used = [], set()
    for sec in SECTIONS:
        names = [n for n in results if _matches(n, sec.prefix)]
        if not names and not missing:
            continue
        lines += [f"## {sec.title}", ""]
        if not names:
            lines += [f"Not measured yet. Produced by: `{sec.produce}`.", ""]
            continue
        for n in names:
            used.add(n)
            short = _name(n, sec.prefix)
            try:
                lines += sec.render(short, results[n], ctx)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
                log.warning("bench: could not render %s.json: %r", n, e)
                lines += [f"Could not render `{n}.json`: {type(e).__name__} {e} (see the schema in "
                          f"`integration/bench.py`, `{sec.render.__name__}`).", ""]
    other = [n for n in results if n not in used]
    if other:
        lines += ["## Other result files", "", "Not rendered by any section: "
                  + ", ".join(f"`{n}.json`" for n in other) + ".", ""]
    return lines


def render_page(results: dict[str, dict], ctx: Ctx, archive_page: str | None = None) -> list[str]:
    """The main page: the current results (by name, so `stages-beauty` precedes `stages-beauty-ablations`),
    then a link to the archive page when there is one."""
    results = dict(sorted(results.items()))
    lines = ["# Benchmarks", "",
             "Generated by `dgr2 bench` from `docs/results/*.json` only; each table names the command and commit",
             "that produced its numbers. " + _MACHINE[0], *_MACHINE[1:]]
    lines += _sections(results, ctx)
    if archive_page:
        lines += ["## Superseded runs", "",
                  f"Runs that a later run of the same measurement replaced are on [their own page]({archive_page}), "
                  "in the order they were made; their files are in `docs/results/archive/`.", ""]
    return lines


def render_archive_page(results: dict[str, dict], ctx: Ctx, main_page: str) -> list[str]:
    """The archive page: superseded runs, oldest first within each section (by their recorded date)."""
    ordered = dict(sorted(results.items(), key=lambda kv: (str(kv[1].get("date") or ""), kv[0])))
    lines = ["# Benchmarks: superseded runs", "",
             "Generated by `dgr2 bench` from `docs/results/archive/*.json`: runs that a later run of the same",
             f"measurement replaced (the current results are in [BENCHMARKS.md]({main_page})), oldest first. Each",
             "table names the command and commit that produced it, with the file name it was written to then.",
             *_MACHINE]
    return lines + _sections(ordered, ctx, missing=False)


def archive_result(path: Path) -> Path:
    """Move a results file that a later run replaces into its folder's archive/, named by the date it
    records (``stages-beauty.json`` of "2026-12-01 17:43 UTC" becomes ``archive/stages-beauty-2026-12-01-1743.json``),
    so it keeps rendering on the archive page. Refuses a file without a recorded date or a name taken."""
    path = Path(path)
    try:
        date = json.loads(path.read_text(encoding="utf-8")).get("date")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable results file ({e})") from None
    stamp = re.fullmatch(r"(\d{4}-\d{2}-\d{2}) (\d{2}):(\d{2}) UTC", str(date or ""))
    if stamp is None:
        raise ValueError(f"{path}: its 'date' is {date!r}, not 'YYYY-MM-DD HH:MM UTC'; archive it by hand")
    dest = path.parent / ARCHIVE / f"{path.stem}-{stamp[1]}-{stamp[2]}{stamp[3]}.json"
    if dest.exists():
        raise FileExistsError(f"{dest} exists; not replacing an archived run")
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, dest)
    return dest


def build_benchmarks(results_dir: Path = RESULTS_DIR, out: Path = Path("docs/BENCHMARKS.md"),
                     plots_dir: Path | None = None) -> Path:
    """Rebuild `out` (and PNGs under plots_dir, default <out's folder>/plots) from results_dir/*.json, and,
    when results_dir/archive holds result files, results_dir/archive/BENCHMARKS.md (PNGs in its plots/)."""
    results_dir, out = Path(results_dir), Path(out)
    archive = read_results(results_dir / ARCHIVE)
    archive_page = None
    if archive:
        archive_out = results_dir / ARCHIVE / "BENCHMARKS.md"
        actx = Ctx(plots_dir=archive_out.parent / "plots", page_dir=archive_out.parent)
        main_link = Path(os.path.relpath(out, archive_out.parent)).as_posix()
        atomic_write_text(archive_out, "\n".join(render_archive_page(archive, actx, main_link)).rstrip() + "\n")
        archive_page = Path(os.path.relpath(archive_out, out.parent)).as_posix()
    ctx = Ctx(plots_dir=Path(plots_dir) if plots_dir is not None else out.parent / "plots", page_dir=out.parent)
    lines = render_page(read_results(results_dir), ctx, archive_page)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(lines).rstrip() + "\n")
    return out
