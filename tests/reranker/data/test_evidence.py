"""Collaborative evidence: co-purchase counts with the user's own pairs excluded, content matches."""

import random
from collections import Counter

import numpy as np
import pandas as pd
import pytest

from reranker.data.evidence import CoPurchaseCounts, ItemMeta, candidate_evidence, item_meta_lookup

SEQS = {
    "u1": ["a", "b", "c"],
    "u2": ["a", "b", "d"],
    "u3": ["x", "a", "b"],
    "u4": ["a", "b", "c", "a", "b"],  # repeats: u4 contributes (a, b) twice
}


def reference_pairs(seqs, window):
    per_user = {}
    for u, s in seqs.items():
        per_user[u] = Counter((s[i], s[j]) for i in range(len(s)) for j in range(i + 1, min(i + 1 + window, len(s))))
    total = sum(per_user.values(), Counter())
    return total, per_user


def test_counts_pairs_right_after():
    cp = CoPurchaseCounts.fit(SEQS)
    assert cp.count("a", "b") == 5
    assert cp.count("b", "a") == 0
    assert cp.count("a", "c") == 0
    assert cp.count("c", "a") == 1
    assert cp.count("a", "unknown") == 0 and cp.count("unknown", "a") == 0


def test_window_counts_later_positions():
    cp = CoPurchaseCounts.fit(SEQS, window=2)
    assert cp.count("a", "c") == 2  # u1 and u4, both "a b c"
    assert cp.count("x", "b") == 1


@pytest.mark.parametrize("window", [1, 3])
def test_matches_brute_force_with_every_user_excluded(window):
    rng = random.Random(window)
    seqs = {f"u{k}": [f"i{rng.randrange(12)}" for _ in range(rng.randrange(1, 9))] for k in range(60)}
    cp = CoPurchaseCounts.fit(seqs, window=window)
    total, per_user = reference_pairs(seqs, window)
    items = sorted({i for s in seqs.values() for i in s})
    for a in items:
        for b in items:
            assert cp.count(a, b) == total[(a, b)]
            for u in ("u0", "u7", "u33"):
                # Excluding a user changes the count by exactly that user's contribution.
                assert cp.count(a, b, exclude_user=u) == total[(a, b)] - per_user[u][(a, b)]
    assert cp.n_pairs == len(total)


def test_users_own_interactions_never_count_for_that_user():
    seqs = dict(SEQS, solo=["p", "q", "p", "q"])  # only "solo" ever bought q after p
    cp = CoPurchaseCounts.fit(seqs)
    assert cp.count("p", "q") == 2
    assert cp.count("p", "q", exclude_user="solo") == 0
    assert cp.count("a", "b", exclude_user="u4") == 3
    assert cp.count("a", "b", exclude_user="nobody") == 5
    meta = {i: ItemMeta("", "", ()) for i in "abcdpqx"}
    ev = candidate_evidence(["p", "q", "p"], "q", meta, cp, user="solo")
    assert ev["copurchase_recent"] == [0, 0, 0]
    assert candidate_evidence(["p"], "q", meta, cp, user="u1")["copurchase_after_last"] == 2


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        CoPurchaseCounts.fit(SEQS, window=0)


def test_candidate_evidence_fields():
    items = pd.DataFrame({
        "item_id": ["h1", "h2", "h3", "h4", "c"],
        "title": ["t"] * 5,
        "brand": ["Acme", "Zest", "Acme", "", "Acme"],
        "categories": [["Beauty", "Lips", "Lipstick"], ["Beauty", "Hair", "Shampoos"],
                       ["Beauty", "Lips", "Gloss"], [], ["Beauty", "Lips", "Lipstick"]],
    })
    meta = item_meta_lookup(items)
    seqs = {"other1": ["h4", "c"], "other2": ["h4", "c"], "other3": ["h3", "c"], "me": ["h1", "h2", "h3", "h4", "c"]}
    cp = CoPurchaseCounts.fit(seqs)
    ev = candidate_evidence(["h1", "h2", "h3", "h4"], "c", meta, cp, user="me")
    assert ev["copurchase_recent"] == [2, 1, 0]  # after h4, h3, h2: most recent first, "me" excluded
    assert (ev["copurchase_after_last"], ev["copurchase_max"], ev["copurchase_sum"]) == (2, 2, 3)
    assert ev["brand_match_count"] == 2 and ev["brand_match"] is True
    assert ev["leaf_category_match_count"] == 1 and ev["leaf_category_match"] is True
    # history categories {Beauty, Lips, Lipstick, Hair, Shampoos, Gloss}; candidate {Beauty, Lips, Lipstick}
    assert ev["category_jaccard"] == pytest.approx(3 / 6)
    assert (ev["leaf_category"], ev["brand"]) == ("Lipstick", "Acme")


def test_empty_brand_and_category_never_match():
    meta = {"h": ItemMeta("", "", ()), "c": ItemMeta("", "", ())}
    ev = candidate_evidence(["h"], "c", meta, CoPurchaseCounts.fit({}), user=None)
    assert ev["brand_match_count"] == 0 and ev["leaf_category_match"] is False
    assert ev["category_jaccard"] == 0.0 and ev["copurchase_recent"] == [0]


def test_meta_lookup_tolerates_raw_strings_and_nan():
    items = pd.DataFrame({"item_id": ["a", "b"], "title": [np.nan, "T"], "brand": ["B", None],
                          "categories": ["Beauty Lips", np.nan]})
    meta = item_meta_lookup(items)
    assert meta["a"] == ItemMeta("", "B", ("Beauty", "Lips")) and meta["a"].leaf_category == "Lips"
    assert meta["b"] == ItemMeta("T", "", ()) and meta["b"].leaf_category == ""
    with pytest.raises(ValueError, match="lacks column"):
        item_meta_lookup(pd.DataFrame({"item_id": ["a"]}))


def test_catalog_knows_the_fields_no_item_has():
    from reranker.data.evidence import absent_fields, absent_fields_note

    items = pd.DataFrame({"item_id": ["a", "b"], "title": ["", np.nan], "brand": ["", None],
                          "categories": ["Beauty Lips", np.nan]})
    meta = item_meta_lookup(items)
    assert absent_fields(meta) == {"title", "brand"} and meta["a"] == ItemMeta("", "", ("Beauty", "Lips"))
    note = absent_fields_note(meta, "x.item")
    assert note.startswith("x.item: no item has a title / brand: ") and "\n" not in note
    full = item_meta_lookup(items.assign(title="T", brand=["B", ""]))
    assert absent_fields(full) == frozenset() and absent_fields_note(full, "x.item") is None
    assert absent_fields({"a": meta["a"]}) == frozenset()  # a plain mapping: nothing known to be absent


@pytest.mark.parametrize("window", [1, 2])
def test_saved_counts_load_back_equal_without_pickle(tmp_path, window):
    """What a release bundle serves from: every count, with every user excluded, as fitted."""
    from reranker.data.evidence import CoPurchaseCounts

    cp = CoPurchaseCounts.fit(SEQS, window=window)
    back = CoPurchaseCounts.load(cp.save(tmp_path / "cp.npz"))
    items = sorted({i for s in SEQS.values() for i in s}) + ["unseen"]
    assert back.window == window and back.n_pairs == cp.n_pairs
    for user in [None, "nobody", *SEQS]:
        assert [[back.count(a, b, user) for b in items] for a in items] == \
               [[cp.count(a, b, user) for b in items] for a in items], user
    with np.load(tmp_path / "cp.npz") as z:
        arrays = dict(z)
    np.savez(tmp_path / "objects.npz", **{**arrays, "items": np.asarray([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="allow_pickle"):  # an object array needs unpickling: refused
        CoPurchaseCounts.load(tmp_path / "objects.npz")
    np.savez(tmp_path / "partial.npz", **{k: v for k, v in arrays.items() if k != "user_ptr"})
    with pytest.raises(ValueError, match=r"lacks array\(s\) \['user_ptr'\]"):
        CoPurchaseCounts.load(tmp_path / "partial.npz")
    with pytest.raises(FileNotFoundError, match="missing.npz: missing"):
        CoPurchaseCounts.load(tmp_path / "missing.npz")


def test_saved_item_catalog_keeps_its_fields_and_what_is_absent(tmp_path):
    from reranker.data.evidence import load_item_catalog, save_item_catalog

    items = pd.DataFrame({"item_id": ["a", "b"], "title": ["A", "B"], "brand": [None, None],
                          "categories": ["x y", None]})
    catalog = item_meta_lookup(items)
    back = load_item_catalog(save_item_catalog(tmp_path / "items.json", catalog, ["a", "b"]))
    assert dict(back) == dict(catalog) and back.absent == catalog.absent == {"brand"}
    (tmp_path / "bad.json").write_text('{"items": {"a": {"title": "A"}}}')
    with pytest.raises(ValueError, match=r"item 'a' lacks field\(s\) \['brand', 'categories'\]"):
        load_item_catalog(tmp_path / "bad.json")
