"""The rule teacher: a LightGBM lambdarank scorer plus GR2-style rejection sampling.

Scorer: fitted on out-of-sample lists only (cross-fitted training-position lists and validation
positions of non-held-out users), early stopping on a held-out share of those users. The teacher
samples rankings from the scorer by Plackett-Luce (Gumbel-perturbed scores / temperature) until
the oracle accepts (target first), up to ``max_tries``; otherwise the targeted fallback (target
first, the rest in scorer order) is used and counted. Each example draws from its own seeded
stream, so results do not depend on processing order.

The scorer that teaches an example must not have been fitted on that example's own list (an
in-sample scorer would rank its training targets first far more often than at test, inflating
the acceptance rate): :class:`CrossFittedScorer` gives each user the model of the other folds.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from candidate_gen.files import atomic_write_text
from reranker.data.features import FEATURE_NAMES
from reranker.data.teachers.base import Teacher, TeachExample, TeacherOutput, example_seed, rejection_sample
from reranker.data.teachers.traces import TraceWriter, trace_rng


@dataclass
class ScorerConfig:
    n_estimators: int = 1000
    learning_rate: float = 0.05
    num_leaves: int = 31
    min_child_samples: int = 50
    early_stopping_rounds: int = 50
    holdout_fraction: float = 0.1  # share of users held out for early stopping
    eval_at: int = 3               # NDCG@k watched by early stopping
    exclude_features: tuple[str, ...] = ()
    n_jobs: int = 1
    seed: int = 0


class LtrScorer:
    """A fitted lambdarank booster and the feature columns it uses."""

    def __init__(self, booster, feature_names: Sequence[str], info: Mapping | None = None):
        self.booster = booster
        self.feature_names = list(feature_names)
        self._cols = [FEATURE_NAMES.index(f) for f in self.feature_names]
        self.info = dict(info or {})

    @classmethod
    def fit(cls, X: np.ndarray, groups: Sequence[int], labels: np.ndarray, users: Sequence[str],
            config: ScorerConfig | None = None) -> "LtrScorer":
        """Fit on lists (``groups`` = list sizes in row order; ``users`` one per list)."""
        import lightgbm as lgb

        cfg = config or ScorerConfig()
        unknown = [f for f in cfg.exclude_features if f not in FEATURE_NAMES]
        if unknown:
            raise ValueError(f"exclude_features: unknown feature(s) {unknown}; known: {list(FEATURE_NAMES)}")
        groups = np.asarray(groups, dtype=np.int64)
        if len(groups) != len(users) or groups.sum() != len(X) or len(labels) != len(X):
            raise ValueError(f"fit: {len(X)} rows, {len(labels)} labels, {groups.sum()} rows in "
                             f"{len(groups)} lists, {len(users)} users do not line up")
        if len(groups) < 2:
            raise ValueError(f"fit: need at least 2 lists with a target, got {len(groups)}")
        names = [f for f in FEATURE_NAMES if f not in cfg.exclude_features]
        cols = [FEATURE_NAMES.index(f) for f in names]
        # Early-stopping holdout by user (a seeded choice that reads no label).
        distinct = sorted(set(users))
        rng = np.random.default_rng(cfg.seed)
        n_hold = int(round(len(distinct) * cfg.holdout_fraction))
        n_hold = min(max(n_hold, 1), len(distinct) - 1) if len(distinct) > 1 else 0
        held = {distinct[i] for i in rng.permutation(len(distinct))[:n_hold]}
        list_held = np.array([u in held for u in users], dtype=bool)
        row_held = np.repeat(list_held, groups)
        params = {
            "objective": "lambdarank", "metric": "ndcg", "eval_at": [int(cfg.eval_at)],
            "learning_rate": cfg.learning_rate, "num_leaves": cfg.num_leaves,
            "min_data_in_leaf": cfg.min_child_samples, "num_threads": cfg.n_jobs, "seed": cfg.seed,
            "deterministic": True, "force_col_wise": True, "verbose": -1,
        }
        X = np.asarray(X, dtype=np.float32)[:, cols]
        labels = np.asarray(labels, dtype=np.float32)
        train = lgb.Dataset(X[~row_held], labels[~row_held], group=groups[~list_held], feature_name=names,
                            free_raw_data=True)
        callbacks, valid_sets = [], []
        if list_held.any():
            valid_sets = [lgb.Dataset(X[row_held], labels[row_held], group=groups[list_held], reference=train)]
            callbacks.append(lgb.early_stopping(cfg.early_stopping_rounds, first_metric_only=True, verbose=False))
        booster = lgb.train(params, train, num_boost_round=cfg.n_estimators, valid_sets=valid_sets,
                            valid_names=["holdout"] * len(valid_sets), callbacks=callbacks)
        best = booster.best_iteration or booster.current_iteration()
        holdout = (booster.best_score.get("holdout", {}) if valid_sets else {})
        info = {"lists": int(len(groups)), "holdout_lists": int(list_held.sum()), "best_iteration": int(best),
                "holdout_ndcg": {k: float(v) for k, v in holdout.items()}, "config": asdict(cfg)}
        info["config"]["exclude_features"] = list(cfg.exclude_features)
        return cls(booster, names, info)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Scores for feature rows laid out as reranker.data.features.FEATURE_NAMES."""
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.shape[1] != len(FEATURE_NAMES):
            raise ValueError(f"expected (rows, {len(FEATURE_NAMES)}) features, got {X.shape}")
        if len(X) == 0:
            return np.zeros(0)
        return self.booster.predict(X[:, self._cols], num_iteration=self.info.get("best_iteration") or None,
                                    num_threads=self.info.get("config", {}).get("n_jobs", 1))

    def importance(self) -> dict[str, float]:
        gain = self.booster.feature_importance("gain", iteration=self.info.get("best_iteration") or None)
        return {f: round(float(g), 3) for f, g in sorted(zip(self.feature_names, gain), key=lambda fg: -fg[1])}

    def model_text(self) -> str:
        return self.booster.model_to_string(num_iteration=self.info.get("best_iteration") or None)

    def save(self, directory) -> None:
        d = Path(directory)
        atomic_write_text(d / "model.txt", self.model_text())
        meta = {"format": "diffusion-gr2/ltr-scorer/v1", "feature_names": self.feature_names, "info": self.info}
        atomic_write_text(d / "scorer.json", json.dumps(meta, indent=2, sort_keys=True))

    @classmethod
    def load(cls, directory) -> "LtrScorer":
        import lightgbm as lgb

        d = Path(directory)
        meta = json.loads((d / "scorer.json").read_text(encoding="utf-8"))
        if meta.get("format") != "diffusion-gr2/ltr-scorer/v1":
            raise ValueError(f"{d / 'scorer.json'}: field 'format': expected 'diffusion-gr2/ltr-scorer/v1', "
                             f"got {meta.get('format')!r}")
        unknown = [f for f in meta["feature_names"] if f not in FEATURE_NAMES]
        if unknown:
            raise ValueError(f"{d / 'scorer.json'}: field 'feature_names': unknown feature(s) {unknown}")
        booster = lgb.Booster(model_str=(d / "model.txt").read_text(encoding="utf-8"))
        info = dict(meta.get("info", {}))
        info["best_iteration"] = 0  # the saved text holds exactly the best iterations
        return cls(booster, meta["feature_names"], info)


class CrossFittedScorer:
    """Per-user scorer: users in fold k get the model fitted without fold k; anyone else the full model."""

    def __init__(self, full: LtrScorer, folds: Sequence[LtrScorer] = (), fold_of: Mapping[str, int] | None = None):
        self.full = full
        self.folds = list(folds)
        self.fold_of = dict(fold_of or {})

    def scorer_for(self, user: str) -> LtrScorer:
        k = self.fold_of.get(user)
        return self.full if k is None else self.folds[k]

    def predict_lists(self, feature_blocks: Sequence[np.ndarray], users: Sequence[str]) -> list[np.ndarray]:
        """Scores per list, one batched predict per model."""
        return predict_per_model([self.scorer_for(u) for u in users], feature_blocks)


def predict_per_model(models: Sequence[LtrScorer], feature_blocks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each list's scores by its own model (``models[i]`` scores ``feature_blocks[i]``), with one
    batched predict per distinct model."""
    out: list[np.ndarray | None] = [None] * len(feature_blocks)
    by_model: dict[int, list[int]] = {}
    for i, m in enumerate(models):
        by_model.setdefault(id(m), []).append(i)
    for idx in by_model.values():
        scores = models[idx[0]].predict(np.concatenate([feature_blocks[i] for i in idx]))
        sizes = np.cumsum([len(feature_blocks[i]) for i in idx])[:-1]
        for i, s in zip(idx, np.split(scores, sizes)):
            out[i] = s
    return out  # type: ignore[return-value]


def fit_cross_fitted(X, groups, labels, users, folds: int, config: ScorerConfig | None = None,
                     seed: int = 0) -> CrossFittedScorer:
    """The full scorer plus ``folds`` user-fold scorers (folds < 2: the full scorer teaches all)."""
    cfg = config or ScorerConfig()
    full = LtrScorer.fit(X, groups, labels, users, cfg)
    if folds < 2:
        return CrossFittedScorer(full)
    distinct = sorted(set(users))
    perm = np.random.default_rng(seed + 7919).permutation(len(distinct))
    fold_of = {distinct[p]: k % folds for k, p in enumerate(perm)}
    groups = np.asarray(groups)
    list_fold = np.array([fold_of[u] for u in users])
    row_fold = np.repeat(list_fold, groups)
    models = []
    for k in range(folds):
        keep_l, keep_r = list_fold != k, row_fold != k
        models.append(LtrScorer.fit(X[keep_r], groups[keep_l], labels[keep_r],
                                    [u for u, f in zip(users, list_fold) if f != k], cfg))
    return CrossFittedScorer(full, models, fold_of)


def plackett_luce_sample(scores: np.ndarray, temperature: float, rng: np.random.Generator) -> list[int]:
    """One ranking from Plackett-Luce with weights exp(score / T) (Gumbel-max trick).
    temperature 0: the deterministic scorer order (ties by retriever order)."""
    s = np.asarray(scores, dtype=np.float64)
    if temperature <= 0:
        return [int(i) for i in np.argsort(-s, kind="stable")]
    keys = s / temperature + rng.gumbel(size=len(s))
    return [int(i) for i in np.argsort(-keys, kind="stable")]


def promote_then_input_order(ranking: Sequence[int], k: int) -> list[int]:
    """The first k items of `ranking`, then every other candidate in input (retriever) order."""
    head = [int(i) for i in ranking[:k]]
    return head + [i for i in range(len(ranking)) if i not in head]


class RuleTeacher(Teacher):
    """Learned scorer + Plackett-Luce rejection sampling + the template trace writer."""

    name = "rule"

    def __init__(self, scorer: CrossFittedScorer | LtrScorer, writer: TraceWriter, temperature: float = 1.0,
                 max_tries: int = 8, seed: int = 0, promote: int | None = 1, rejection: bool = True):
        self.scorer = scorer if isinstance(scorer, CrossFittedScorer) else CrossFittedScorer(scorer)
        # How many items of the accepted ranking go to the front; the rest keep the retriever
        # order. The Plackett-Luce tail below them is a random draw that nothing in the prompt or
        # the trace determines, and a small LM trained on it learns to repeat SIDs instead of
        # copying the candidates (measured on Beauty: 0% valid rankings after one SFT epoch).
        # None keeps the whole sampled permutation.
        if promote is not None and int(promote) < 1:
            raise ValueError(f"promote must be >= 1 or None, got {promote}")
        self.promote = None if promote is None else int(promote)
        # rejection=False: the scorer's own proposal is the answer, right or wrong (distillation of
        # the scorer). Its label is a function of the evidence, where an accepted sample's label is
        # the target itself: on Beauty the "cpu" LM fitted to targets learned the prior of each
        # position (#1 first ~40%) and nothing of the evidence in one epoch.
        self.rejection = bool(rejection)
        self.writer = writer
        self.temperature = float(temperature)
        self.max_tries = int(max_tries)
        self.seed = int(seed)
        if self.max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {max_tries}")

    def _teach_scored(self, ex: TeachExample, scores: np.ndarray) -> TeacherOutput:
        rng = np.random.default_rng(example_seed(self.seed, ex.user, ex.position))
        if self.rejection:
            ranking, tries = rejection_sample(lambda _k: plackett_luce_sample(scores, self.temperature, rng),
                                              ex.oracle, self.max_tries)
            fallback = ranking is None
            if fallback:
                ranking = ex.oracle.targeted(plackett_luce_sample(scores, 0.0, rng))
            accepted = not fallback
        else:
            # The first proposal is the answer; `accepted` only records whether it was right (the
            # teacher's own hit rate). Promotion below keeps its first item.
            ranking, tries, fallback = plackett_luce_sample(scores, self.temperature, rng), 1, False
            accepted = ex.oracle.accept(ranking)
        if self.promote is not None:
            ranking = promote_then_input_order(ranking, self.promote)
        reasoning = self.writer.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history,
                                      trace_rng(self.seed, ex.user, ex.position))
        return TeacherOutput(reasoning, tuple(ranking), accepted, tries, fallback, self.name)

    def _check(self, ex: TeachExample) -> None:
        if ex.features is None:
            raise ValueError(f"rule teacher: example (user {ex.user!r}, position {ex.position}) has no features")

    def teach(self, example: TeachExample) -> TeacherOutput:
        self._check(example)
        scores = self.scorer.scorer_for(example.user).predict(example.features)
        return self._teach_scored(example, scores)

    def teach_many(self, examples: Sequence[TeachExample], desc: str = "teaching") -> list[TeacherOutput]:
        from tqdm.auto import tqdm

        for ex in examples:
            self._check(ex)
        scores = self.scorer.predict_lists([e.features for e in examples], [e.user for e in examples])
        return [self._teach_scored(e, s) for e, s in
                tqdm(zip(examples, scores), total=len(examples), desc=desc, unit="ex", leave=False, mininterval=2.0)]


__all__ = ["ScorerConfig", "LtrScorer", "CrossFittedScorer", "fit_cross_fitted", "plackett_luce_sample",
           "RuleTeacher"]
