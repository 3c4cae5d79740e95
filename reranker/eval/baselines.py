"""Non-LM baselines on a built re-ranking test split: the numbers the language model must beat.

* retriever: the incoming order (the floor every re-ranker is compared with);
* random: a seeded random permutation per user;
* copurchase_last: sort by how often other users bought the candidate right after the user's last
  history item (training split, the user's own pairs excluded), ties by retriever order;
* copurchase_recent_brand: sort by the counts after the last, second-to-last and third-to-last
  history items, then the same-brand history count, compared in that order (lexicographic), ties by
  retriever order. Its head is the pick of the "scan_brand" trace (reranker/data/retrace.py), so it is
  the rule a model trained on those traces follows, applied without the LM;
* copurchase_recent_brand_pick: that sort's head, the rest in retriever order: exactly the answer the
  "scan_brand" trace writes (the whole sort is what its "_top3" variant approaches);
* learned_scorer: LightGBM (lambdarank) on the same features, no LM, fitted here on every list made at
  a validation position outside the test split: the train split's `source: valid` lists and the
  valid split. Those come from the retriever and position the test lists come from (on Beauty, fitted
  with half of the valid split and measured on the other 971 validation users: R@1 0.349, NDCG@3
  0.484; with the 17,642 cross-fitted earlier-position lists added, 0.338 and 0.488). Its settings
  are the data build's scorer's (``<data_dir>/scorer``). That scorer is fitted on the train split
  alone, which a large selection split leaves with few validation-position lists (480 on Beauty:
  test R@1 0.312), so it is not the baseline.

Each gets Recall@1/@3 and NDCG@3/@5 and paired bootstrap 95% CIs of its differences with the
retriever order and with the learned scorer (same users).

``split="valid"`` measures the same baselines on the selection users' validation lists instead, so
choices can be weighed against them without reading the test split: there the learned scorer is
cross-fitted over two halves of the users (each half scored by a scorer fitted without it), so it
learns from about half of the lists the test baseline's scorer learns from.

The learned scorer is reranker/data/preranker.py's PreRanker: a data directory built with
``candidate_order: scorer`` carries the one its prompts were ordered by, and that one is the baseline
(a model that writes the rest of its list in that order is compared with exactly that order);
otherwise it is fitted here the same way.

``run_baselines`` returns a dict for docs/results/rerank-baselines-<name>.json (``save_baselines``);
``baselines_table`` renders it as Markdown.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from candidate_gen.atomic import load_items
from candidate_gen.files import atomic_write_text
from candidate_gen.split import train_sequences
from reranker.data.dataset import load_retrieval, load_split, scorer_settings
from reranker.data.evidence import item_meta_lookup
from reranker.data.features import FEATURE_NAMES, FeatureContext
from reranker.data.preranker import PreRanker, order_by, preranker_dir
from reranker.eval.metrics import compare, new_ranks, summarize

_CP_LAST = FEATURE_NAMES.index("copurchase_last1")
_RECENT_BRAND = [FEATURE_NAMES.index(f) for f in
                 ("copurchase_last1", "copurchase_last2", "copurchase_last3", "brand_match_count")]


def _order_lexicographic(rows: np.ndarray) -> list[int]:
    """Candidate indices by their feature tuples, descending, first column first; ties keep retriever order."""
    keys = [tuple(float(v) for v in r) for r in np.asarray(rows)]
    return sorted(range(len(keys)), key=lambda j: tuple(-v for v in keys[j]) + (j,))


# Baselines results carry this; a stored baselines.json of another version is recomputed.
BASELINES_VERSION = 4  # 4: the learned scorer is the PreRanker (its valid folds exclude whole user halves)
SPLITS = ("test", "valid")


def scorer_lists(data_dir: Path) -> list[dict]:
    """The lists the learned-scorer baseline learns from (module docstring) that have their target
    among the candidates."""
    rows = [r for r in load_split(data_dir, "train") if r.get("source") == "valid"] + load_split(data_dir, "valid")
    return [r for r in rows if r.get("target") in r["candidates"]]


def learned_scorer(data_dir: Path, ctx: FeatureContext, seed: int = 0) -> PreRanker | None:
    """The learned-scorer baseline (module docstring): the data's own pre-ranker, else one fitted on
    `scorer_lists` with the data build's scorer settings; None when fewer than two lists have a target."""
    info_path = data_dir / "build_info.json"
    info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
    where = preranker_dir(data_dir, info)  # what the build_info says, not a leftover directory
    if where is not None:
        return PreRanker.load(where)
    rows = scorer_lists(data_dir)
    if len(rows) < 2:
        return None
    saved = data_dir / "scorer" / "scorer.json"
    settings = json.loads(saved.read_text(encoding="utf-8")).get("info", {}).get("config", {}) if saved.is_file() else {}
    return PreRanker.fit(rows, ctx, scorer_settings(settings, int(settings.get("seed", 0))), seed)


def _resolve_inputs(data_dir: Path, retrieval_dir, items_path):
    """Explicit paths win; otherwise the ones recorded (relative to data_dir) in build_info.json."""
    if retrieval_dir is not None and items_path is not None:
        return Path(retrieval_dir), Path(items_path)
    info_path = data_dir / "build_info.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path}: not found; pass retrieval_dir and items_path explicitly")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    return (Path(retrieval_dir) if retrieval_dir is not None else data_dir / info["retrieval_dir"],
            Path(items_path) if items_path is not None else data_dir / info["items_path"])


def baseline_permutations(rows, ctx: FeatureContext, scorer: PreRanker | None, seed: int = 0,
                          cross_fitted: bool = False) -> dict[str, list[list[int]]]:
    """Each baseline's permutation per row; the learned scorer's from ``scorer`` (cross_fitted: each
    row by the model fitted without its user's half)."""
    X, groups = ctx.featurize(rows, desc="baseline features")
    offsets = np.concatenate([[0], np.cumsum(groups)]).astype(int)
    learned = None if scorer is None else scorer.orders(X, groups, [r["user"] for r in rows], cross_fitted)
    perms: dict[str, list[list[int]]] = {"retriever": [], "random": [], "copurchase_last": [],
                                         "copurchase_recent_brand": [], "copurchase_recent_brand_pick": []}
    if scorer is not None:
        perms["learned_scorer"] = []
    rng = np.random.default_rng([int(seed), 17])
    for i, row in enumerate(rows):
        n = len(row["candidates"])
        a, b = offsets[i], offsets[i + 1]
        perms["retriever"].append(list(range(n)))
        perms["random"].append([int(j) for j in rng.permutation(n)])
        perms["copurchase_last"].append(order_by(X[a:b, _CP_LAST]))
        rule = _order_lexicographic(X[a:b][:, _RECENT_BRAND])
        perms["copurchase_recent_brand"].append(rule)
        perms["copurchase_recent_brand_pick"].append([rule[0]] + [j for j in range(n) if j != rule[0]])
        if learned is not None:
            perms["learned_scorer"].append(learned[i])
    return perms


def split_permutations(data_dir, retrieval_dir=None, items_path=None, seed: int = 0, split: str = "test"):
    """(rows, {baseline name: permutation per row}) for ``data_dir``/<split>.jsonl (test or valid)."""
    if split not in SPLITS:
        raise ValueError(f"baselines are measured on {' or '.join(SPLITS)}, got split {split!r}")
    data_dir = Path(data_dir)
    retrieval_dir, items_path = _resolve_inputs(data_dir, retrieval_dir, items_path)
    rows = load_split(data_dir, split)
    if not rows:
        raise ValueError(f"{data_dir / f'{split}.jsonl'}: no examples")
    for k, r in enumerate(rows, start=1):
        if not isinstance(r.get("target_index"), int):
            raise ValueError(f"{data_dir / f'{split}.jsonl'}:{k}: field 'target_index': expected an int, "
                             f"got {r.get('target_index')!r}")
    seqs, _ = load_retrieval(retrieval_dir)
    ctx = FeatureContext(train_sequences(seqs), item_meta_lookup(load_items(items_path).to_frame()))
    scorer = learned_scorer(data_dir, ctx, seed)
    if scorer is not None and split == "valid" and None in scorer.folds:
        scorer = None  # a half of the users left too few lists to fit a scorer without it
    # valid: each half of the selection users scored by a scorer that never saw it
    return rows, baseline_permutations(rows, ctx, scorer, seed, cross_fitted=split == "valid")


def baseline_ranks(data_dir, retrieval_dir=None, items_path=None, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-user 0-based rank of the target under every baseline on the test split (paired comparisons)."""
    return _target_ranks(*split_permutations(data_dir, retrieval_dir, items_path, seed))


def _target_ranks(rows, perms) -> dict[str, np.ndarray]:
    targets = [r["target_index"] for r in rows]
    return {name: new_ranks(p, targets) for name, p in perms.items()}


def run_baselines(data_dir, retrieval_dir=None, items_path=None, n_boot: int = 2000, seed: int = 0,
                  split: str = "test") -> dict:
    """Baselines on ``data_dir``/<split>.jsonl (built by reranker.data.dataset.build_rerank_data)."""
    rows, perms = split_permutations(data_dir, retrieval_dir, items_path, seed, split)
    ranks = _target_ranks(rows, perms)
    floor = ranks["retriever"]
    scorer = ranks.get("learned_scorer")
    methods = {name: {"metrics": summarize(r),
                      "vs_retriever": compare(floor, r, n_boot=n_boot, seed=seed) if name != "retriever" else None,
                      # what a re-ranker must beat to be worth its cost (issue: at or above the scorer)
                      "vs_learned_scorer": (compare(scorer, r, n_boot=n_boot, seed=seed)
                                            if scorer is not None and name != "learned_scorer" else None)}
               for name, r in ranks.items()}
    users = {"test_users": len(rows)} if split == "test" else {"split": split, "users": len(rows)}
    return {"version": BASELINES_VERSION, **users, "n_candidates": len(rows[0]["candidates"]),
            "n_boot": n_boot, "seed": seed, "methods": methods}


def baselines_table(result: dict) -> str:
    """Markdown table: metric (difference vs retriever [95% CI])."""
    cols = ("recall@1", "recall@3", "ndcg@3", "ndcg@5")
    lines = ["| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, m in result["methods"].items():
        cells = []
        for c in cols:
            cell = f"{m['metrics'][c]:.4f}"
            if m["vs_retriever"]:
                d = m["vs_retriever"][c]
                cell += f" ({d['diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}])"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def save_baselines(result: dict, path) -> None:
    """Write the result as JSON (atomically), e.g. docs/results/rerank-baselines-<name>.json."""
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
