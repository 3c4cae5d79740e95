"""`dgr2 eval`: re-rank a split of the re-ranking data with a model and report accuracy and speed.

Reports Recall@1/3, NDCG@3/5, the valid-output rate and each failure kind, the fallback rate, the
copy-the-input-order rate, generated tokens and decode tokens/s, with paired bootstrap 95% CIs of
every metric's difference against the retriever order (and against any reference run given).
Invalid output falls back to the order the prompt listed (the retriever's, as in the paper, or the
pre-ranker's: reranker/data/preranker.py). The valid split's lists are ordered by the pre-ranker's
cross-fitted models (`engine_for_split`), as the data build ordered them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from candidate_gen.files import read_jsonl

from reranker.engine import DecodeOptions, RerankEngine, RerankRequest, rerank_batches
from reranker.text.answer import FAILURE_KINDS
from .metrics import compare, new_ranks, summarize


def load_examples(path: Path, limit: int | None = None) -> list[dict]:
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: missing; build the re-ranking data with `dgr2 data build`")
    return read_jsonl(path, {"history": list, "candidates": list, "target_index": int}, limit)


def request_of(row: dict) -> RerankRequest:
    """The engine request of a data row."""
    return RerankRequest(row["history"], row["candidates"], row.get("scores"), row.get("user"), row.get("history_len"))


def engine_for_split(model_dir, data_dir, split: str, device: str = "cpu") -> RerankEngine:
    """The engine for evaluating ``split``: on the valid split a pre-ranker orders each list with the
    model fitted without its user (the selection users' lists are in what the full model was fitted on)."""
    return RerankEngine.load(model_dir, data_dir, device=device, cross_fitted=split == "valid")


def check_list_orders(engine: RerankEngine, examples: list[dict], where: str) -> None:
    """Rows that record the order their prompt listed the candidates in (``prompt_order``, data built
    with a pre-ranker) must get that order from the engine too, or the model is scored on prompts
    it was not selected on: a ValueError names the first row that differs."""
    for k, row in enumerate(examples, start=1):
        if "prompt_order" not in row:
            continue
        if getattr(engine, "preranker", None) is None:
            raise ValueError(f"{where}:{k}: the data lists candidates in a pre-ranker's order (field "
                             f"'prompt_order'), the engine has no pre-ranker: its data directory's build_info.json "
                             f"does not say candidate_order: scorer")
        if row.get("split") == "train":
            raise ValueError(f"{where}:{k}: train prompts are ordered by the data build's teaching scorer, which the "
                             f"engine does not carry; evaluate the valid or test split")
        got = engine.list_order(request_of(row))
        if got != list(row["prompt_order"]):
            split = row.get("split", "?")
            raise ValueError(f"{where}:{k}: the engine lists the candidates as {got}, the data's prompt as "
                             f"{row['prompt_order']} (its field 'prompt_order'); a {split} list needs the pre-ranker "
                             f"{'cross-fitted (engine_for_split)' if split == 'valid' else 'without cross-fitting'}"
                             f" (the engine's: {'cross-fitted' if engine.cross_fitted else 'full model'})")


def evaluate(engine: RerankEngine, examples: list[dict], options: DecodeOptions, batch_size: int = 8,
             progress: bool = True, keep_outputs: bool = False, workers: int = 1) -> dict:
    """Decode every example (batches of batch_size, in order) and score the rankings.

    workers: batches decoded at once (reranker.engine.rerank_batches). The same batches either way;
    `decode_seconds` then sums the workers' decode times, `wall_seconds` is the elapsed time."""
    t0 = time.perf_counter()
    chunks = [examples[b:b + batch_size] for b in range(0, len(examples), batch_size)]
    decoded = rerank_batches(engine, [[request_of(r) for r in chunk] for chunk in chunks], options, workers)
    perms, outputs, shown = [], [], []
    failures = {k: 0 for k in FAILURE_KINDS}
    valid = gen_tokens = n_forward = 0
    decode_seconds = row_tokens = 0.0
    bar = tqdm(total=len(examples), desc=f"eval {options.decoder}", unit="ex", disable=not progress)
    for chunk, results in zip(chunks, decoded):
        decode_seconds += results[0].decode_seconds if results else 0.0
        n_forward += results[0].forward_passes if results else 0
        row_tokens += sum(r.generated_tokens for r in results) / max(len(results), 1)  # mean row length
        for r in results:
            perms.append(r.permutation)
            shown.append(r.list_order if r.list_order is not None else list(range(len(r.permutation))))
            valid += r.valid
            gen_tokens += r.generated_tokens
            if r.failure:
                failures[r.failure] += 1
        if keep_outputs:
            for ex, r in zip(chunk, results):
                outputs.append({"user": ex.get("user"), "target_index": int(ex["target_index"]), "valid": r.valid,
                                "failure": r.failure, "permutation": r.permutation, "text": r.text,
                                "generated_tokens": r.generated_tokens, "forward_passes": r.forward_passes})
        bar.update(len(chunk))
    bar.close()
    n = len(examples)
    target_index = [int(r["target_index"]) for r in examples]
    ranks = new_ranks(perms, target_index)
    floor = np.asarray(target_index)
    report = {
        "n": n, "decoder": options.decoder, "tau": options.tau, "block_size": options.block_size,
        "commit_rule": options.commit_rule, "hold_eos": options.hold_eos, "temperature": options.temperature,
        "max_new_tokens": options.max_new_tokens, "compute_dtype": options.compute_dtype,
        "batch_size": batch_size, "workers": workers, **summarize(ranks),
        "valid_rate": valid / max(n, 1), "fallback_rate": 1 - valid / max(n, 1),
        "failures": failures,
        # answers that repeat the order the prompt listed (the retriever's or the pre-ranker's)
        "copy_order_rate": float(np.mean([p == o for p, o in zip(perms, shown)])) if n else 0.0,
        "generated_tokens": gen_tokens, "mean_generated_tokens": gen_tokens / max(n, 1),
        "decode_seconds": decode_seconds, "tokens_per_second": gen_tokens / max(decode_seconds, 1e-9),
        # per row (as reranker.eval.speed): AR 1 whatever the batch; _batched divides by every row's tokens
        "forward_passes": n_forward, "forward_passes_per_token": n_forward / max(row_tokens, 1e-12),
        "forward_passes_per_token_batched": n_forward / max(gen_tokens, 1),
        "wall_seconds": time.perf_counter() - t0,
        "retriever": summarize(floor), "vs_retriever": compare(floor, ranks),
        "ranks": ranks.tolist(),
    }
    if any(o != list(range(len(o))) for o in shown):
        # A pre-ranker listed the candidates: what the model adds is its difference with that order.
        listed = new_ranks(shown, target_index)
        report.update(listed_order=summarize(listed), vs_listed_order=compare(listed, ranks))
    if keep_outputs:
        report["outputs"] = outputs
    return report


def evaluate_dirs(model_dir, data_dir, split: str = "test", options: DecodeOptions | None = None,
                  batch_size: int = 8, limit: int | None = None, progress: bool = True,
                  keep_outputs: bool = False, settings: dict | None = None, workers: int = 1) -> dict:
    """options None: `settings` (the decode settings given, by name) over what the model records
    (RerankEngine.decode_options)."""
    data_dir = RerankEngine.data_dir_for(model_dir, data_dir)  # None: the model's release bundle
    engine = engine_for_split(model_dir, data_dir, split)
    path = Path(data_dir) / f"{split}.jsonl"
    examples = load_examples(path, limit)
    check_list_orders(engine, examples, str(path))
    options = options if options is not None else engine.decode_options(settings)
    report = evaluate(engine, examples, options, batch_size, progress, keep_outputs, workers)
    report.update({"model": str(model_dir), "data": str(data_dir), "split": split})
    return report


def write_outputs(path, outputs: list[dict]) -> Path:
    """One JSON line per example (user, target_index, valid, failure, permutation, the generated
    text), in split order, written to a temp file and renamed: what `dgr2 eval --outputs` keeps for
    looking at the failures one by one."""
    from candidate_gen.files import atomic_write_text

    return atomic_write_text(path, "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs))


def format_report(rep: dict) -> str:
    lines = [f"{rep['decoder']} on {rep['n']} examples (valid {rep['valid_rate']:.4f}, "
             f"fallback {rep['fallback_rate']:.4f}, copy-order {rep['copy_order_rate']:.4f}, "
             f"{rep['tokens_per_second']:.1f} tok/s, {rep['forward_passes_per_token']:.3f} passes/token)",
             f"{'metric':10s} {'retriever':>10s} {'model':>10s} {'diff':>9s}  95% CI"]
    for k, ci in rep["vs_retriever"].items():
        lines.append(f"{k:10s} {rep['retriever'][k]:10.4f} {rep[k]:10.4f} {ci['diff']:+9.4f}  "
                     f"[{ci['ci_low']:+.4f}, {ci['ci_high']:+.4f}]")
    if rep.get("vs_listed_order"):
        lines.append("against the order the prompts listed (the pre-ranker's):")
        for k, ci in rep["vs_listed_order"].items():
            lines.append(f"{k:10s} {rep['listed_order'][k]:10.4f} {rep[k]:10.4f} {ci['diff']:+9.4f}  "
                         f"[{ci['ci_low']:+.4f}, {ci['ci_high']:+.4f}]")
    fails = ", ".join(f"{k} {v}" for k, v in rep["failures"].items())
    lines.append(f"failures: {fails}")
    return "\n".join(lines)
