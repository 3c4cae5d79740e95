"""Per-candidate learning-to-rank features: retriever, co-purchase, content and popularity.

One row per (list, candidate). Everything is computed from the candidate list, the user's
history and counts over the TRAINING split (each user's sequence minus its last two items), with
the user's own interactions subtracted: a training example's target and later items are in that
user's training sequence, so counting them would show the ranker its own answer (and the +1 is
never there at test time, where those items are excluded from the candidates). Nothing here reads
a row's ``target``.

Speed: one Python pass per list with O(1) work per candidate after per-list aggregates; the
co-purchase lookups are binary searches (~2 µs). About 100 µs per 10-candidate list, so ~150k
lists take well under a minute.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from reranker.data.evidence import RECENT_FOR_COPURCHASE, CoPurchaseCounts, ItemMeta, as_item_meta

FEATURE_NAMES = (
    "retriever_rank",        # 0-based position in the retriever's list
    "retriever_score",       # raw score (scale is model-specific: cross-fitted vs main retriever)
    "score_gap_to_top",      # top score - this score
    "score_z",               # score standardised within the list (scale-free)
    "copurchase_last1",      # bought right after the last history item (by other users)
    "copurchase_last2",      # ... after the second-to-last item
    "copurchase_last3",      # ... after the third-to-last item
    "copurchase_max",
    "copurchase_sum",
    "copurchase_last1_norm",  # copurchase_last1 / everything bought right after the last item
    "copurchase_last1_share",  # copurchase_last1 / its sum over the list
    "brand_match_count",     # history items of the same brand
    "leaf_category_match_count",
    "category_jaccard",      # categories of the candidate vs the union over the history
    "same_brand_as_last",
    "same_leaf_as_last",
    "popularity",            # training-split interactions of the candidate, user's own excluded
    "popularity_rank_in_list",
    "history_len",
)
N_FEATURES = len(FEATURE_NAMES)
_EMPTY = ItemMeta("", "", ())


def _pair_starts(seq: Sequence[str], window: int) -> Counter:
    """How many ordered pairs (a, .) within ``window`` each item a starts in one sequence."""
    n = len(seq)
    out: Counter = Counter()
    for i, a in enumerate(seq):
        k = min(window, n - 1 - i)
        if k > 0:
            out[a] += k
    return out


class FeatureContext:
    """Training-split statistics shared by every list (fit once, reuse for all splits)."""

    def __init__(self, train_sequences: Mapping[str, Sequence[str]], items_meta, window: int = 1,
                 copurchase: CoPurchaseCounts | None = None):
        """``copurchase``: the counts of these sequences when already made (a release bundle's saved
        ones), else they are counted here."""
        self.meta = as_item_meta(items_meta)
        self.train_sequences = train_sequences
        self.copurchase = copurchase if copurchase is not None else CoPurchaseCounts.fit(train_sequences, window=window)
        self.window = self.copurchase.window
        self.popularity: Counter = Counter()
        self.out_count: Counter = Counter()
        for seq in train_sequences.values():
            self.popularity.update(seq)
            self.out_count.update(_pair_starts(seq, self.window))
        self._user_cache: tuple[str | None, Counter, Counter] = (None, Counter(), Counter())

    def _user_counts(self, user: str) -> tuple[Counter, Counter]:
        """(item counts, pair-start counts) of one user's training sequence; rows come sorted by
        user, so a one-entry cache removes nearly all recomputation."""
        # One read and one write of the whole tuple: the engine computes features on several threads
        # at once, and a cache read in parts could mix two users' counts.
        cached = self._user_cache
        if cached[0] != user:
            seq = self.train_sequences.get(user, ())
            cached = (user, Counter(seq), _pair_starts(seq, self.window))
            self._user_cache = cached
        return cached[1], cached[2]

    def list_features(self, user: str, history: Sequence[str], candidates: Sequence[str],
                      scores: Sequence[float], history_len: int | None = None) -> np.ndarray:
        """(len(candidates), N_FEATURES) float32 for one list; ``history`` is time ordered."""
        n = len(candidates)
        if len(scores) != n:
            raise ValueError(f"user {user!r}: {len(scores)} scores for {n} candidates")
        meta, cp = self.meta, self.copurchase
        own_items, own_starts = self._user_counts(user)
        hist_meta = [meta.get(h, _EMPTY) for h in history]
        brands = Counter(m.brand for m in hist_meta if m.brand)
        leaves = Counter(m.leaf_category for m in hist_meta if m.leaf_category)
        hist_cats = set().union(*(m.categories for m in hist_meta)) if hist_meta else set()
        last = hist_meta[-1] if hist_meta else _EMPTY
        recent = list(reversed(history[-RECENT_FOR_COPURCHASE:]))
        out_last = (self.out_count[history[-1]] - own_starts[history[-1]]) if history else 0

        x = np.zeros((n, N_FEATURES), dtype=np.float64)
        sc = np.asarray(scores, dtype=np.float64)
        x[:, 0] = np.arange(n)
        x[:, 1] = sc
        x[:, 2] = sc.max() - sc if n else 0.0
        std = sc.std()
        x[:, 3] = (sc - sc.mean()) / std if std > 1e-12 else 0.0
        for j, cand in enumerate(candidates):
            counts = [cp.count(h, cand, exclude_user=user) for h in recent]
            counts += [0] * (RECENT_FOR_COPURCHASE - len(counts))
            x[j, 4:7] = counts
            x[j, 7] = max(counts)
            x[j, 8] = sum(counts)
            x[j, 9] = counts[0] / out_last if out_last > 0 else 0.0
            m = meta.get(cand, _EMPTY)
            x[j, 11] = brands[m.brand] if m.brand else 0
            x[j, 12] = leaves[m.leaf_category] if m.leaf_category else 0
            cats = set(m.categories)
            union = hist_cats | cats
            x[j, 13] = len(hist_cats & cats) / len(union) if union else 0.0
            x[j, 14] = bool(m.brand) and m.brand == last.brand
            x[j, 15] = bool(m.leaf_category) and m.leaf_category == last.leaf_category
            x[j, 16] = self.popularity[cand] - own_items[cand]
        total_last = x[:, 4].sum()
        x[:, 10] = x[:, 4] / total_last if total_last > 0 else 0.0
        # Rank 0 = most popular in this list; ties keep retriever order (stable sort).
        order = np.argsort(-x[:, 16], kind="stable")
        x[order, 17] = np.arange(n)
        x[:, 18] = len(history) if history_len is None else history_len
        return x.astype(np.float32)

    def featurize(self, rows: Sequence[Mapping], desc: str = "features") -> tuple[np.ndarray, np.ndarray]:
        """Stack :meth:`list_features` over rows (dicts with user, history, candidates, scores and
        optionally history_len). Returns (X, group_sizes)."""
        blocks, groups = [], []
        for k, row in enumerate(tqdm(rows, desc=desc, unit="list", leave=False, mininterval=2.0)):
            try:
                user, history, cands, scores = row["user"], row["history"], row["candidates"], row["scores"]
            except KeyError as err:
                raise KeyError(f"{desc}: row {k} lacks field {err.args[0]!r}") from None
            blocks.append(self.list_features(user, history, cands, scores, row.get("history_len")))
            groups.append(len(cands))
        if not blocks:
            return np.zeros((0, N_FEATURES), dtype=np.float32), np.zeros(0, dtype=np.int64)
        return np.concatenate(blocks), np.asarray(groups, dtype=np.int64)
