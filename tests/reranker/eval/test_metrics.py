import numpy as np
import pytest

from reranker.eval.metrics import compare, new_ranks, paired_bootstrap, summarize


def test_ranks_and_metrics():
    ranks = new_ranks([[2, 0, 1], [0, 1, 2]], [2, 1])
    assert ranks.tolist() == [0, 1]
    s = summarize(ranks)
    assert s["recall@1"] == 0.5 and s["recall@3"] == 1.0
    assert s["ndcg@3"] == pytest.approx((1.0 + 1.0 / np.log2(3)) / 2)


def test_bootstrap_detects_a_real_difference_and_not_a_null_one():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 2000).astype(float)
    better = np.where(rng.random(2000) < 0.1, 1.0, a)
    r = paired_bootstrap(a, better)
    assert r["ci_low"] > 0
    same = paired_bootstrap(a, a.copy())
    assert same["ci_low"] == same["ci_high"] == 0
    noise = paired_bootstrap(a, rng.permutation(a))
    assert noise["ci_low"] < 0 < noise["ci_high"]


def test_compare_shapes_must_match():
    with pytest.raises(ValueError, match="same users"):
        compare(np.zeros(3, int), np.zeros(4, int))
