"""The pre-ranker: a learned scorer that orders each candidate list before the language model reads it.

With ``rerank_data.candidate_order: scorer`` a prompt lists the retriever's candidates in this
scorer's order ("Candidates (scorer order)."), and the rule traces answer with their pick first and
the rest in that order. The model's list is then the scorer's below a head the model chose, so what
the model adds over the scorer is that head, and the whole list is ordered, not only its first item
(docs/EXPERIMENTS.md, "The candidates in the learned scorer's order").

It is the learned-scorer baseline (reranker/eval/baselines.py) made part of the pipeline: LightGBM
(lambdarank) on reranker.data.features, fitted on every list made at a validation position outside
the test split (the train split's validation-position lists and the valid split), the lists the test
lists resemble. No list is ordered by a model that saw its own target:

* test lists and served requests: the full model;
* valid lists (``cross_fitted``): the model fitted without the user's half of the users (``user_fold``,
  a seeded hash of the user id), so model selection reads lists no order was fitted on.

Train prompts are ordered by the data build's teaching scorer (fitted on train lists alone), so the
valid split's targets still build no training data.

Saved as plain text (LightGBM model files and JSON), never pickled: ``preranker/full/``,
``preranker/fold<k>/`` and ``preranker/preranker.json``.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from candidate_gen.files import atomic_write_text
from reranker.data.features import FeatureContext
from reranker.data.teachers.rule import LtrScorer, ScorerConfig, predict_per_model

FORMAT = "diffusion-gr2/preranker/v1"
FOLDS = 2  # user halves the valid lists' models are cross-fitted over
CANDIDATE_ORDERS = ("retriever", "scorer")  # what a prompt's candidate list follows


def preranker_dir(data_dir, info: Mapping) -> Path | None:
    """Where the pre-ranker of a data directory or release bundle is, from its build_info.json
    ``info``; None for data whose prompts keep the retriever's order."""
    order = info.get("candidate_order", "retriever")
    if order not in CANDIDATE_ORDERS:
        raise ValueError(f"{Path(data_dir) / 'build_info.json'}: field 'candidate_order': expected one of "
                         f"{CANDIDATE_ORDERS}, got {order!r}")
    if order == "retriever":
        return None
    return Path(data_dir) / (info.get("artifacts") or {}).get("preranker", "preranker")


def user_fold(user: str, folds: int, seed: int) -> int:
    """A user's fold: a seeded hash, so it does not depend on which lists are loaded."""
    return zlib.crc32(f"{seed}:{user}".encode()) % folds


def _labels(rows: Sequence[Mapping]) -> np.ndarray:
    return np.concatenate([[c == r["target"] for c in r["candidates"]] for r in rows]).astype(np.float32)


def fit_scorer(rows: Sequence[Mapping], ctx: FeatureContext, config: ScorerConfig) -> LtrScorer | None:
    """One LightGBM scorer on ``rows`` (lists whose target is among the candidates); None when fewer
    than two lists are given."""
    if len(rows) < 2:
        return None
    X, groups = ctx.featurize(rows, desc="pre-ranker features")
    scorer = LtrScorer.fit(X, groups, _labels(rows), [r["user"] for r in rows], config)
    scorer.info["fitted_lists"] = len(rows)
    return scorer


class PreRanker:
    """The full model, one model per user fold (each fitted without that fold), and the fold hash's seed."""

    def __init__(self, full: LtrScorer, folds: Sequence[LtrScorer | None], seed: int):
        self.full, self.folds, self.seed = full, list(folds), int(seed)

    @classmethod
    def fit(cls, rows: Sequence[Mapping], ctx: FeatureContext, config: ScorerConfig, seed: int,
            folds: int = FOLDS) -> "PreRanker":
        """Fit on ``rows``: every list made at a validation position outside the test split whose
        target is among its candidates."""
        rows = [r for r in rows if r.get("target") in r["candidates"]]
        full = fit_scorer(rows, ctx, config)
        if full is None:
            raise ValueError(f"the pre-ranker needs at least 2 validation-position lists with their target, "
                             f"got {len(rows)}")
        fold_models = [fit_scorer([r for r in rows if user_fold(r["user"], folds, seed) != k], ctx, config)
                       for k in range(folds)]
        return cls(full, fold_models, seed)

    def scorer_for(self, user: str | None, cross_fitted: bool = False) -> LtrScorer:
        if not cross_fitted:
            return self.full
        if user is None:
            raise ValueError("a cross-fitted order needs the request's user")
        model = self.folds[user_fold(user, len(self.folds), self.seed)]
        if model is None:
            raise ValueError(f"the pre-ranker has no model fitted without user {user!r}'s fold")
        return model

    def scores(self, X: np.ndarray, groups: Sequence[int], users: Sequence[str | None],
               cross_fitted: bool = False) -> list[np.ndarray]:
        """Scores per list of the stacked features ``X`` (``groups``: list sizes), one predict per model."""
        offsets = np.concatenate([[0], np.cumsum(groups)]).astype(int)
        blocks = [X[offsets[i]:offsets[i + 1]] for i in range(len(users))]
        return predict_per_model([self.scorer_for(u, cross_fitted) for u in users], blocks)

    def orders(self, X: np.ndarray, groups: Sequence[int], users: Sequence[str | None],
               cross_fitted: bool = False) -> list[list[int]]:
        """Each list's candidate indices by score, best first; ties keep retriever order."""
        return [order_by(s) for s in self.scores(X, groups, users, cross_fitted)]

    def save(self, directory) -> None:
        d = Path(directory)
        self.full.save(d / "full")
        for k, m in enumerate(self.folds):
            if m is not None:
                m.save(d / f"fold{k}")
        atomic_write_text(d / "preranker.json", json.dumps(
            {"format": FORMAT, "folds": len(self.folds), "seed": self.seed,
             "fold_models": [m is not None for m in self.folds]}, indent=2) + "\n")

    @classmethod
    def load(cls, directory) -> "PreRanker":
        d = Path(directory)
        path = d / "preranker.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; the data build writes it with candidate_order: scorer")
        meta = json.loads(path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: field 'format': expected {FORMAT!r}, got {meta.get('format')!r}")
        n, present = meta.get("folds"), meta.get("fold_models")
        if not isinstance(n, int) or n < 2 or not isinstance(present, list) or len(present) != n:
            raise ValueError(f"{path}: fields 'folds' and 'fold_models': expected a count >= 2 and one flag per "
                             f"fold, got {n!r} and {present!r}")
        missing = [k for k in range(n) if present[k] and not (d / f"fold{k}" / "model.txt").is_file()]
        if missing:
            raise ValueError(f"{path}: fold model(s) {missing} are marked present but {d}/fold{missing[0]}/model.txt "
                             "is missing")
        folds = [LtrScorer.load(d / f"fold{k}") if present[k] else None for k in range(n)]
        return cls(LtrScorer.load(d / "full"), folds, int(meta.get("seed", 0)))


def order_by(values) -> list[int]:
    """Indices by value, descending; ties keep the incoming (retriever) order."""
    return [int(i) for i in np.argsort(-np.asarray(values, dtype=np.float64), kind="stable")]
