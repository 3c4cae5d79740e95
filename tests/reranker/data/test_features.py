"""Learning-to-rank features: agree with the prompt's evidence, never read the target, and never
count the user's own interactions."""

import random

import numpy as np
import pandas as pd
import pytest

from reranker.data.evidence import candidates_evidence, item_meta_lookup
from reranker.data.features import FEATURE_NAMES, FeatureContext

F = {name: i for i, name in enumerate(FEATURE_NAMES)}


def world(seed=0, n_items=60, n_users=80):
    rng = random.Random(seed)
    items = pd.DataFrame({
        "item_id": [f"i{k}" for k in range(n_items)],
        "title": [f"title {k}" for k in range(n_items)],
        "brand": [rng.choice(["Ab", "Cd", "Ef", ""]) for _ in range(n_items)],
        "categories": [["Beauty", rng.choice(["Skin", "Hair"]), rng.choice(["Creams", "Oils", "Gels"])]
                       for _ in range(n_items)],
    })
    ids = list(items["item_id"])
    seqs = {}
    for u in range(n_users):
        start = rng.randrange(n_items)
        seqs[f"u{u}"] = [ids[(start + 3 * k + rng.randrange(2)) % n_items] for k in range(rng.randint(5, 12))]
    return items, seqs


def rows_for(seqs, items, rng, n=10):
    ids = list(items["item_id"])
    rows = []
    for user, seq in seqs.items():
        history, target = seq[:-1], seq[-1]
        pool = [i for i in ids if i not in history and i != target]
        cands = rng.sample(pool, n - 1) + [target]
        rng.shuffle(cands)
        scores = sorted((rng.random() for _ in cands), reverse=True)
        rows.append({"user": user, "history": history, "candidates": cands, "scores": scores, "target": target})
    return rows


@pytest.fixture(scope="module")
def setup():
    items, seqs = world()
    train = {u: s[:-2] for u, s in seqs.items()}
    meta = item_meta_lookup(items)
    ctx = FeatureContext(train, meta)
    rows = rows_for(seqs, items, random.Random(1))
    return items, seqs, train, meta, ctx, rows


def test_shapes_and_retriever_columns(setup):
    *_, ctx, rows = setup
    X, groups = ctx.featurize(rows)
    assert X.shape == (10 * len(rows), len(FEATURE_NAMES)) and X.dtype == np.float32
    assert list(groups) == [10] * len(rows)
    first = X[:10]
    assert list(first[:, F["retriever_rank"]]) == list(range(10))
    assert first[0, F["score_gap_to_top"]] == 0 and (first[:, F["score_gap_to_top"]] >= 0).all()
    assert abs(first[:, F["score_z"]].mean()) < 1e-5


def test_features_agree_with_prompt_evidence(setup):
    _, _, _, meta, ctx, rows = setup
    for row in rows[:20]:
        x = ctx.list_features(row["user"], row["history"], row["candidates"], row["scores"])
        ev = candidates_evidence(row["history"], row["candidates"], meta, ctx.copurchase, row["user"])
        for j, e in enumerate(ev):
            recent = e["copurchase_recent"] + [0] * (3 - len(e["copurchase_recent"]))
            assert list(x[j, F["copurchase_last1"]:F["copurchase_last3"] + 1]) == recent
            assert x[j, F["copurchase_max"]] == e["copurchase_max"]
            assert x[j, F["copurchase_sum"]] == e["copurchase_sum"]
            assert x[j, F["brand_match_count"]] == e["brand_match_count"]
            assert x[j, F["leaf_category_match_count"]] == e["leaf_category_match_count"]
            assert x[j, F["category_jaccard"]] == pytest.approx(e["category_jaccard"], abs=1e-6)


def test_features_never_read_the_target(setup):
    *_, ctx, rows = setup
    X, _ = ctx.featurize(rows)
    scrubbed = [{k: v for k, v in r.items() if k != "target"} for r in rows]
    X2, _ = ctx.featurize(scrubbed)
    assert np.array_equal(X, X2)


def test_own_interactions_are_not_counted(setup):
    """Each user's features equal those from counts fitted WITHOUT that user's sequence at all."""
    _, _, train, meta, ctx, rows = setup
    for row in rows[:15]:
        others = {u: s for u, s in train.items() if u != row["user"]}
        alone = FeatureContext(others, meta)
        a = ctx.list_features(row["user"], row["history"], row["candidates"], row["scores"])
        b = alone.list_features(row["user"], row["history"], row["candidates"], row["scores"])
        assert np.array_equal(a, b), row["user"]


def test_training_position_target_gets_no_self_count():
    """At a training position the target is in the user's own training sequence: it must not
    raise the target's popularity or its co-purchase with the last item."""
    train = {"u": ["a", "b", "c", "d"], "v": ["a", "x"]}
    meta = item_meta_lookup(pd.DataFrame({"item_id": list("abcdx"), "title": [""] * 5, "brand": [""] * 5,
                                          "categories": [[]] * 5}))
    ctx = FeatureContext(train, meta)
    x = ctx.list_features("u", ["a"], ["b", "x"], [0.5, 0.4])
    assert x[0, F["popularity"]] == 0 and x[0, F["copurchase_last1"]] == 0  # b: only u bought it
    assert x[1, F["popularity"]] == 1 and x[1, F["copurchase_last1"]] == 1  # x: v bought a -> x
    assert x[1, F["copurchase_last1_norm"]] == 1.0  # v's a -> x is everything after a, u excluded
    assert FeatureContext(train, meta).copurchase.count("a", "b") == 1  # sanity: u's pair exists


def test_mismatched_scores_are_reported(setup):
    *_, ctx, rows = setup
    with pytest.raises(ValueError, match="9 scores for 10 candidates"):
        ctx.list_features(rows[0]["user"], rows[0]["history"], rows[0]["candidates"], rows[0]["scores"][:9])
