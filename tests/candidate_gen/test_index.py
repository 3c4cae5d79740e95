import numpy as np
import pytest

from candidate_gen.index import ItemIndex


@pytest.fixture
def vectors():
    rng = np.random.default_rng(0)
    return rng.normal(size=(500, 16)).astype(np.float32), [f"i{k}" for k in range(500)]


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivfpq"])
def test_save_load_round_trip(tmp_path, vectors, kind):
    x, ids = vectors
    idx = ItemIndex.build(x, ids, kind, nlist=8, pq_m=4)
    q = x[:20] + 0.01
    before = idx.search(q, 10)
    idx.save(tmp_path / kind)
    again = ItemIndex.load(tmp_path / kind)
    after = again.search(q, 10)
    assert again.kind == kind and again.item_ids == ids
    np.testing.assert_array_equal(before[1], after[1])


def test_exact_matches_numpy_and_excludes_history(vectors):
    x, ids = vectors
    idx = ItemIndex.build(x, ids)
    q = x[:5] @ np.eye(16, dtype=np.float32)
    order = np.argsort(-(q @ x.T), axis=1)
    exclude = [{ids[j] for j in order[r, :30]} for r in range(5)]  # force the re-search path
    items, scores = idx.top_n_excluding(q, exclude, 10)
    for r in range(5):
        assert items[r] == [ids[j] for j in order[r, 30:40]]
        assert scores[r] == sorted(scores[r], reverse=True)


def test_hnsw_recall(vectors):
    x, ids = vectors
    q = np.random.default_rng(1).normal(size=(100, 16)).astype(np.float32)
    exact = ItemIndex.build(x, ids).search(q, 10)[1]
    approx = ItemIndex.build(x, ids, "hnsw").search(q, 10)[1]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, approx)])
    assert recall >= 0.99


def test_load_missing_dir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="items.faiss: missing"):
        ItemIndex.load(tmp_path)


def test_hnsw_scores_are_inner_products(vectors):
    x, ids = vectors
    x = x * np.linspace(0.5, 2.0, len(x), dtype=np.float32)[:, None]  # unequal norms: the hard MIPS case
    q = np.random.default_rng(2).normal(size=(20, 16)).astype(np.float32)
    scores, ix = ItemIndex.build(x, ids, "hnsw").search(q, 10)
    np.testing.assert_allclose(scores, np.take_along_axis(q @ x.T, ix, axis=1), rtol=1e-4, atol=1e-4)
    assert (np.diff(scores, axis=1) <= 1e-5).all()
