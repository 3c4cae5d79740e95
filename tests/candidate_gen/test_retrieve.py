import json

from candidate_gen.retrieve import RetrievalSettings, run_retrieval

TINY_SASREC = {"epochs": 2, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 1,
               "train_batch_size": 256, "MAX_ITEM_LIST_LENGTH": 20}


def test_retrieval_end_to_end(tmp_path, tiny_catalog):
    res = run_retrieval(RetrievalSettings(out=tmp_path / "r", data_dir=tiny_catalog, sasrec=TINY_SASREC,
                                          n_candidates=10, crossfit_folds=2))
    # FAISS exact lists are exactly RecBole's history-masked full-sort lists.
    assert res["faiss_recbole_top10_agreement"] == 1.0
    assert res["hnsw_recall@10"] >= 0.99
    for key in ("recall@10", "ndcg@10", "recall@10_masked", "ndcg@10_masked", "recall@50_masked",
                "train_hit_rate_in_sample", "train_hit_rate_crossfit"):
        assert 0.0 <= res[key] <= 1.0, key
    seqs = json.loads((tmp_path / "r" / "sequences.json").read_text())
    for split in ("train", "valid", "test"):
        rows = [json.loads(line) for line in (tmp_path / "r" / "candidates" / f"{split}.jsonl").open()]
        assert rows
        for row in rows[:200]:
            full = seqs[row["user"]]
            assert row["target"] == full[row["position"]]
            assert len(row["candidates"]) == 10 and len(set(row["candidates"])) == 10
            assert not set(row["candidates"]) & set(full[: row["position"]])  # history excluded
            assert row["scores"] == sorted(row["scores"], reverse=True)
    # Cross-fitting: every training row comes from the fold model that never saw its user.
    train = [json.loads(line) for line in (tmp_path / "r" / "candidates" / "train.jsonl").open()]
    folds = {}
    for row in train:
        folds.setdefault(row["user"], set()).add(row["fold"])
    assert all(len(f) == 1 for f in folds.values())
    fold_data = (tmp_path / "r" / "folds" / "fold0" / "data" / "tiny" / "tiny.inter").read_text()
    fold0_users = {u for u, f in folds.items() if f == {0}}
    assert fold0_users and not any(f"\n{u}\t" in fold_data for u in fold0_users)
