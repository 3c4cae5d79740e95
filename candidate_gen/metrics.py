"""Next-item metrics with one target per example (leave-one-out), as RecBole computes them."""
from __future__ import annotations

import numpy as np


def target_ranks(ranked: list[list[str]], targets: list[str]) -> np.ndarray:
    """0-based rank of each target in its ranked list, or -1 when absent."""
    out = np.full(len(targets), -1, dtype=np.int64)
    for k, (lst, t) in enumerate(zip(ranked, targets)):
        try:
            out[k] = lst.index(t)
        except ValueError:
            pass
    return out


def recall_at(ranks: np.ndarray, k: int) -> float:
    return float(np.mean((ranks >= 0) & (ranks < k))) if len(ranks) else 0.0


def ndcg_at(ranks: np.ndarray, k: int) -> float:
    if not len(ranks):
        return 0.0
    hit = (ranks >= 0) & (ranks < k)
    gains = np.where(hit, 1.0 / np.log2(np.where(hit, ranks, 0) + 2.0), 0.0)
    return float(np.mean(gains))
