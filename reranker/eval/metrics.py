"""Re-ranking metrics per user and paired bootstrap confidence intervals.

Every accuracy difference the project reports (against the retriever order, against AR) is a
paired bootstrap over the same users: resample users with replacement, recompute the mean
difference, take the 2.5 / 97.5 percentiles.
"""
from __future__ import annotations

import numpy as np

CUTOFFS = {"recall@1": ("recall", 1), "recall@3": ("recall", 3), "ndcg@3": ("ndcg", 3), "ndcg@5": ("ndcg", 5)}


def new_ranks(permutations: list[list[int]], target_index: list[int]) -> np.ndarray:
    """0-based rank of the target after re-ranking; a permutation lists candidate indices best first."""
    return np.array([perm.index(t) for perm, t in zip(permutations, target_index)], dtype=np.int64)


def per_user(ranks: np.ndarray, cutoffs: dict = CUTOFFS) -> dict[str, np.ndarray]:
    """Per-user metric values (one target per user) for every cut-off (default: the reported ones)."""
    ranks = np.asarray(ranks)
    out = {}
    for name, (kind, k) in cutoffs.items():
        hit = ranks < k
        out[name] = hit.astype(np.float64) if kind == "recall" else np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0)
    return out


def summarize(ranks: np.ndarray) -> dict[str, float]:
    return {k: float(v.mean()) for k, v in per_user(ranks).items()}


def paired_bootstrap(a: np.ndarray, b: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Mean of b - a with a 95% paired bootstrap interval (users resampled jointly)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired bootstrap needs the same users: {a.shape} vs {b.shape}")
    diff = b - a
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diff), size=(n_boot, len(diff)))
    means = diff[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"diff": float(diff.mean()), "ci_low": float(lo), "ci_high": float(hi)}


def compare(base_ranks: np.ndarray, new: np.ndarray, n_boot: int = 2000, seed: int = 0) -> dict[str, dict]:
    """Paired bootstrap of every metric: new ranking vs base ranking, same users."""
    pa, pb = per_user(base_ranks), per_user(new)
    return {k: paired_bootstrap(pa[k], pb[k], n_boot, seed) for k in CUTOFFS}
