"""Semantic IDs: content embeddings, RQ-KMeans codes, dedup level, persistence."""

import os
import re

import numpy as np
import pandas as pd
import pytest

from reranker.text.sid import (
    SID_CODEBOOK,
    SemanticIds,
    build_semantic_ids,
    content_embeddings,
    effective_codebook_size,
    format_sid,
    parse_sid,
    sid_token_vocabulary,
)

BRANDS = ["Acme", "Lumo", "Nordic_Glow", "Petal", "Zest", ""]
PATHS = [
    ["Beauty", "Makeup", "Face", "Concealers"],
    ["Beauty", "Makeup", "Lips", "Lipstick"],
    ["Beauty", "Hair_Care", "Shampoos"],
    ["Beauty", "Skin_Care", "Face", "Creams_&_Moisturizers"],
]


def tiny_items(n=120, seed=0):
    rng = np.random.default_rng(seed)
    words = ["matte", "gloss", "repair", "hydrating", "volume", "shine", "rose", "mint", "argan", "silk"]
    rows = []
    for i in range(n):
        path = PATHS[i % len(PATHS)]
        rows.append({
            "item_id": f"i{i:04d}",
            "title": " ".join(rng.choice(words, size=3)) + f" {path[-1]}",
            "brand": BRANDS[i % len(BRANDS)],
            "categories": list(path),
        })
    return pd.DataFrame(rows)


SID_RE = re.compile(r"<\|sid_begin\|><a_\d+><b_\d+><c_\d+><d_\d+><\|sid_end\|>")


def test_tfidf_embeddings_shape_norm_and_determinism():
    items = tiny_items()
    e1 = content_embeddings(items, dim=16, seed=3)
    e2 = content_embeddings(items, dim=16, seed=3)
    assert e1.shape == (len(items), 16) and e1.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e1, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(e1, e2)


def test_tfidf_pads_small_catalogs_and_zero_rows_for_empty_items():
    items = pd.DataFrame({
        "item_id": ["a", "b", "c"],
        "title": ["red lipstick", "", "blue shampoo"],
        "brand": ["Acme", "", "Zest"],
        "categories": [["Lips"], [], ["Hair"]],
    })
    e = content_embeddings(items, dim=64)
    assert e.shape == (3, 64)
    assert np.all(e[1] == 0)  # no text at all -> zero row, not NaN
    assert np.isfinite(e).all()


def test_embedding_errors_name_the_problem():
    with pytest.raises(ValueError, match="lacks column"):
        content_embeddings(pd.DataFrame({"item_id": ["a"]}))
    with pytest.raises(ValueError, match="unknown embedding method 'bert'"):
        content_embeddings(tiny_items(8), method="bert")


def test_sentence_transformers_method():
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    model_dir = os.environ.get("DGR2_ST_MODEL_DIR")
    if not model_dir:
        pytest.skip("set DGR2_ST_MODEL_DIR to a local sentence-transformers model directory")
    e = content_embeddings(tiny_items(8), method="sentence-transformers", model_dir=model_dir)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-4)


def test_sentence_transformers_without_model_dir_is_a_clear_error():
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="sentence-transformers"):
            content_embeddings(tiny_items(8), method="sentence-transformers")
    else:
        with pytest.raises(ValueError, match="model_dir"):
            content_embeddings(tiny_items(8), method="sentence-transformers")


def test_codebook_size_shrinks_for_small_catalogs():
    assert effective_codebook_size(12101) == 256
    assert effective_codebook_size(120) == 30
    assert effective_codebook_size(5) == 2
    assert effective_codebook_size(1) == 1
    with pytest.raises(ValueError, match="n_items=0"):
        effective_codebook_size(0)
    with pytest.raises(ValueError, match="codebook_size"):
        effective_codebook_size(100, 512)


def test_semantic_ids_are_unique_valid_and_reported():
    items = tiny_items()
    emb = content_embeddings(items, dim=16)
    sids = build_semantic_ids(emb, items["item_id"], seed=0)
    rep = sids.report()
    assert rep["n_items"] == len(items)
    assert rep["unique_fraction"] == 1.0
    assert rep["codebook_sizes"][:3] == [30, 30, 30]
    assert 0.0 <= rep["collision_rate_after_3_levels"] < 1.0
    strings = {sids.sid_string(i) for i in items["item_id"]}
    assert len(strings) == len(items)
    for item in items["item_id"]:
        s = sids.sid_string(item)
        assert SID_RE.fullmatch(s)
        assert sids.item_for_sid_string(s) == item
        assert all(0 <= c < SID_CODEBOOK for c in sids.codes(item))


def test_deterministic_under_seed():
    items = tiny_items()
    emb = content_embeddings(items, dim=16)
    a = build_semantic_ids(emb, items["item_id"], seed=7)
    b = build_semantic_ids(emb, items["item_id"], seed=7)
    assert all(a.codes(i) == b.codes(i) for i in items["item_id"])


def test_identical_items_are_told_apart_by_the_fourth_code():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 8)).astype(np.float32)
    emb[[5, 17, 30]] = emb[5]  # three items with the same content
    ids = [f"x{i:02d}" for i in range(40)]
    sids = build_semantic_ids(emb, ids)
    trio = [sids.codes(i) for i in ("x05", "x17", "x30")]
    assert len({c[:3] for c in trio}) == 1
    assert sorted(c[3] for c in trio) == [0, 1, 2]
    assert [c[3] for c in trio] == [0, 1, 2]  # numbered by sorted item id
    assert sids.report()["unique_fraction"] == 1.0


def test_too_many_items_on_one_prefix_is_an_error():
    emb = np.ones((SID_CODEBOOK + 4, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=r"260 items share the prefix"):
        build_semantic_ids(emb, [f"z{i}" for i in range(len(emb))])


def test_build_rejects_bad_inputs():
    emb = np.zeros((3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="does not match 2 item ids"):
        build_semantic_ids(emb, ["a", "b"])
    with pytest.raises(ValueError, match="'a' appears more than once"):
        build_semantic_ids(emb, ["a", "b", "a"])
    with pytest.raises(ValueError, match="levels=2"):
        build_semantic_ids(emb, ["a", "b", "c"], levels=2)


def test_lookups_fail_loudly():
    sids = SemanticIds({"a": (1, 2, 3, 0)})
    assert sids.sid_string("a") == "<|sid_begin|><a_1><b_2><c_3><d_0><|sid_end|>"
    with pytest.raises(KeyError, match="'zzz'"):
        sids.sid_string("zzz")
    with pytest.raises(KeyError, match="no item has the SID"):
        sids.item_for_sid_string(format_sid((1, 2, 3, 1)))
    with pytest.raises(ValueError, match="not a SID string"):
        sids.item_for_sid_string("<a_1><b_2><c_3><d_0>")
    with pytest.raises(ValueError, match="share the SID"):
        SemanticIds({"a": (1, 2, 3, 0), "b": (1, 2, 3, 0)})


def test_save_load_round_trip(tmp_path):
    items = tiny_items(40)
    sids = build_semantic_ids(content_embeddings(items, dim=8), items["item_id"])
    path = tmp_path / "sub" / "sids.json"
    sids.save(path)
    loaded = SemanticIds.load(path)
    assert loaded.item_ids == sids.item_ids
    assert all(loaded.codes(i) == sids.codes(i) for i in sids.item_ids)
    assert loaded.report() == sids.report()
    assert [p.name for p in path.parent.iterdir()] == ["sids.json"]  # no temp file left


def test_vocabulary_and_parse():
    vocab = sid_token_vocabulary()
    assert len(vocab) == 4 * 256 + 2 and len(set(vocab)) == len(vocab)
    assert parse_sid("<|sid_begin|><a_97><b_168><c_137><d_135><|sid_end|>") == (97, 168, 137, 135)
