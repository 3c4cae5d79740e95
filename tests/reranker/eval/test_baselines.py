"""Non-LM baselines on a hand-made retrieval directory whose answers are known: purchases follow
item chains (k -> k+1), and every test target sits at retriever rank 5."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from candidate_gen.atomic import ItemTable, write_items
from reranker.data.dataset import build_rerank_data
from reranker.eval.baselines import baseline_permutations, baselines_table, run_baselines

torch.set_num_threads(1)
N_ITEMS, N_USERS, TEST_RANK = 40, 120, 4


def _row(rng, user, seq, pos, split, items, target_rank=None, fold=None):
    history, target = seq[:pos], seq[pos]
    pool = [i for i in items if i not in history and i != target]
    cands = rng.sample(pool, 9)
    cands.insert(rng.randrange(10) if target_rank is None else target_rank, target)
    row = {"user": user, "position": pos, "split": split, "history": history[-50:], "history_len": pos,
           "target": target, "candidates": cands, "scores": sorted((round(rng.random(), 6) for _ in cands), reverse=True)}
    if fold is not None:
        row["fold"] = fold
    return row


def fake_retrieval(root: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    items = [f"i{k:02d}" for k in range(N_ITEMS)]
    table = ItemTable()
    for k, item in enumerate(items):
        table.titles[item] = f"Thing {k}"
        table.brands[item] = f"Brand{k % 5}"
        table.categories[item] = ["Beauty", f"Leaf{k % 7}"]
    write_items(root / "fake.item", table)
    seqs = {}
    for u in range(N_USERS):
        k = rng.randrange(N_ITEMS)
        seq = []
        for _ in range(rng.randint(6, 9)):
            seq.append(items[k])
            k = (k + 1) % N_ITEMS if rng.random() < 0.85 else rng.randrange(N_ITEMS)
            while items[k] in seq:
                k = (k + 1) % N_ITEMS
        seqs[f"u{u:03d}"] = seq
    r = root / "retrieval"
    (r / "candidates").mkdir(parents=True)
    (r / "sequences.json").write_text(json.dumps(seqs))
    rows = {"train": [], "valid": [], "test": []}
    for user, seq in seqs.items():
        n = len(seq)
        rows["train"] += [_row(rng, user, seq, t, "train", items, fold=u % 2) for u, t in enumerate(range(1, n - 2))]
        rows["valid"].append(_row(rng, user, seq, n - 2, "valid", items))
        rows["test"].append(_row(rng, user, seq, n - 1, "test", items, target_rank=TEST_RANK))
    for split, rs in rows.items():
        (r / "candidates" / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs))
    return r, root / "fake.item"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("baselines")
    r, items = fake_retrieval(root)
    build_rerank_data(r, items, root / "data", n_selection_users=10, tokenizer_vocab=400, seed=0,
                      scorer_config={"n_estimators": 60, "min_child_samples": 10})
    return root / "data", r, items


def test_baselines_on_known_answers(built):
    data, r, items = built
    res = run_baselines(data, r, items, n_boot=300)
    assert res["test_users"] == N_USERS and set(res["methods"]) == {
        "retriever", "random", "copurchase_last", "copurchase_recent_brand", "copurchase_recent_brand_pick",
        "learned_scorer"}
    floor = res["methods"]["retriever"]
    assert floor["vs_retriever"] is None
    assert floor["metrics"]["recall@1"] == 0 and floor["metrics"]["recall@3"] == 0
    assert floor["metrics"]["ndcg@5"] == pytest.approx(1 / np.log2(TEST_RANK + 2))
    for name in ("copurchase_last", "learned_scorer"):
        m = res["methods"][name]
        assert m["metrics"]["recall@1"] > 0.6, name
        d = m["vs_retriever"]["recall@1"]
        assert d["ci_low"] > 0 and d["ci_low"] <= d["diff"] <= d["ci_high"]
    assert 0.0 < res["methods"]["random"]["metrics"]["recall@1"] < 0.3
    json.dumps(res)  # the results file must serialise
    table = baselines_table(res)
    assert table.count("\n") == 8 and "| copurchase_last |" in table and "[+" in table


def test_baselines_are_seeded_and_paths_come_from_build_info(built):
    data, r, items = built
    a = run_baselines(data, n_boot=200, seed=1)  # paths from build_info.json (relative to data)
    b = run_baselines(data, r, items, n_boot=200, seed=1)
    assert a == b


def test_learned_scorer_is_fitted_on_every_validation_position_list_outside_test(built):
    """The baseline scorer learns from the lists made like the test lists (the train split's
    validation-position lists and the selection users' valid split), not the data build's scorer."""
    from candidate_gen.split import train_sequences
    from reranker.data.dataset import load_split
    from reranker.data.features import FeatureContext
    from reranker.eval.baselines import learned_scorer

    data, r, items = built
    train, valid = load_split(data, "train"), load_split(data, "valid")
    n_valid_source = sum(row["source"] == "valid" for row in train)
    assert 0 < n_valid_source < len(train) and len(valid) == 10
    ctx = FeatureContext(train_sequences(json.loads((r / "sequences.json").read_text())), {})
    scorer = learned_scorer(data, ctx)
    assert scorer.full.info["fitted_lists"] == n_valid_source + len(valid)
    saved = json.loads((data / "scorer" / "scorer.json").read_text())["info"]["config"]
    assert scorer.full.info["config"]["n_estimators"] == saved["n_estimators"] == 60  # the build's settings


def test_valid_split_baselines_cross_fit_the_scorer_over_user_halves(built):
    """On the validation lists no list is scored by a scorer that was fitted on it: each half of
    the selection users is scored by the scorer fitted without that half."""
    from candidate_gen.split import train_sequences
    from reranker.data.dataset import load_split
    from reranker.data.features import FeatureContext
    from reranker.data.preranker import FOLDS, user_fold
    from reranker.eval.baselines import learned_scorer, split_permutations

    data, r, items = built
    res = run_baselines(data, n_boot=200, split="valid")
    valid = load_split(data, "valid")
    assert res["split"] == "valid" and res["users"] == len(valid) and "test_users" not in res
    assert res["methods"]["learned_scorer"]["metrics"]["recall@1"] > 0.5
    assert res["methods"]["learned_scorer"]["vs_learned_scorer"] is None
    d = res["methods"]["retriever"]["vs_learned_scorer"]["recall@1"]
    m = {k: res["methods"][k]["metrics"]["recall@1"] for k in ("retriever", "learned_scorer")}
    assert d["diff"] == pytest.approx(m["retriever"] - m["learned_scorer"]) and d["ci_low"] <= d["diff"] <= d["ci_high"]
    rows, perms = split_permutations(data, seed=0, split="valid")
    assert [row["user"] for row in rows] == [row["user"] for row in valid]
    halves = [{row["user"] for row in valid if user_fold(row["user"], FOLDS, 0) == f} for f in range(2)]
    assert all(halves) and not halves[0] & halves[1]
    from candidate_gen.atomic import load_items
    from reranker.data.evidence import item_meta_lookup

    ctx = FeatureContext(train_sequences(json.loads((r / "sequences.json").read_text())),
                         item_meta_lookup(load_items(items).to_frame()))  # as split_permutations builds it
    scorer = learned_scorer(data, ctx)
    fitted = [row for row in load_split(data, "train") if row["source"] == "valid"] + valid
    for k, model in enumerate(scorer.folds):  # each fold's model never saw a list of its half's users
        assert model.info["fitted_lists"] == sum(user_fold(row["user"], FOLDS, 0) != k for row in fitted)
    X, groups = ctx.featurize(rows)
    assert perms["learned_scorer"] == scorer.orders(X, groups, [row["user"] for row in rows], cross_fitted=True)
    # the rule's pick first, the rest in retriever order
    for rule, pick in zip(perms["copurchase_recent_brand"], perms["copurchase_recent_brand_pick"]):
        assert pick == [rule[0]] + [j for j in range(len(rule)) if j != rule[0]]
    with pytest.raises(ValueError, match="test or valid, got split 'train'"):
        run_baselines(data, split="train")


def test_copurchase_sort_breaks_ties_by_retriever_order(built):
    from candidate_gen.split import train_sequences
    from reranker.data.features import FeatureContext

    data, r, items = built
    seqs = json.loads((r / "sequences.json").read_text())
    ctx = FeatureContext(train_sequences(seqs), {})
    row = {"user": "nobody", "history": ["zz"], "candidates": ["a", "b", "c"], "scores": [3, 2, 1]}
    perms = baseline_permutations([row], ctx, None)
    assert perms["copurchase_last"] == [[0, 1, 2]] and perms["retriever"] == [[0, 1, 2]]
    assert perms["copurchase_recent_brand"] == perms["copurchase_recent_brand_pick"] == [[0, 1, 2]]
    assert "learned_scorer" not in perms
