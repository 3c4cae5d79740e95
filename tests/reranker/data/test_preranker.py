"""Data built with `candidate_order: scorer`: prompts list the candidates in the pre-ranker's order,
the rule traces answer in it, and every reader (baselines, retrace, copies, the engine's order) agrees
with the order the data recorded."""

import json

import numpy as np
import pytest

from reranker.data.dataset import build_rerank_data, load_split
from reranker.data.features import N_FEATURES
from reranker.data.preranker import PreRanker, user_fold
from reranker.text.prompt import prompt_candidate_sids
from tests.reranker.eval.test_baselines import fake_retrieval


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("preranker")
    r, items = fake_retrieval(root)
    build_rerank_data(r, items, root / "data", n_selection_users=10, tokenizer_vocab=400, seed=0,
                      scorer_config={"n_estimators": 60, "min_child_samples": 10}, trace_style="scan_brand",
                      candidate_order="scorer")
    return root / "data", r, items


def _user(row):
    return row["prompt_messages"][1]["content"]


def _features(r, items):
    from candidate_gen.atomic import load_items
    from candidate_gen.split import train_sequences
    from reranker.data.evidence import item_meta_lookup
    from reranker.data.features import FeatureContext

    return FeatureContext(train_sequences(json.loads((r / "sequences.json").read_text())),
                          item_meta_lookup(load_items(items).to_frame()))


def test_prompts_list_the_candidates_in_the_recorded_order_and_answers_keep_it(scored):
    data, r, items = scored
    info = json.loads((data / "build_info.json").read_text())
    assert info["candidate_order"] == "scorer" and info["artifacts"]["preranker"] == "preranker"
    moved = 0
    for split in ("train", "valid", "test"):
        for row in load_split(data, split):
            order, text = row["prompt_order"], _user(row)
            assert sorted(order) == list(range(len(row["candidates"])))
            assert "\nCandidates (scorer order)." in text and "\nScorer order: " in text
            assert "retriever order" not in text
            assert prompt_candidate_sids(text) == [row["candidate_sids"][j] for j in order]
            moved += order != sorted(order)
            if split != "test":  # the scan's pick first, then the rest as the prompt lists them
                ranking = row["ranking"]
                assert ranking[1:] == [j for j in order if j != ranking[0]]
                assert "the rest in scorer order" in row["reasoning"]
                assert json.loads(row["assistant"].split("</think>\n")[1])["ranking"] == [
                    row["candidate_sids"][j] for j in ranking]
    assert moved > 20  # the pre-ranker does reorder most lists


def test_valid_and_test_orders_come_from_the_saved_preranker(scored):
    """Valid lists are ordered by the model fitted without their user's half, test lists by the full
    model; the learned-scorer baseline is that same pre-ranker."""
    from reranker.eval.baselines import split_permutations

    data, r, items = scored
    pre = PreRanker.load(data / "preranker")
    ctx = _features(r, items)
    train = load_split(data, "train")
    fitted = [row for row in train if row["source"] == "valid"] + load_split(data, "valid")
    assert pre.full.info["fitted_lists"] == len(fitted)
    for k, model in enumerate(pre.folds):
        assert model.info["fitted_lists"] == sum(user_fold(row["user"], 2, 0) != k for row in fitted)
    for split, cross in (("valid", True), ("test", False)):
        rows = load_split(data, split)
        X, groups = ctx.featurize(rows)
        assert pre.orders(X, groups, [row["user"] for row in rows], cross) == [row["prompt_order"] for row in rows]
        _, perms = split_permutations(data, split=split)
        assert perms["learned_scorer"] == [row["prompt_order"] for row in rows]
    rows = load_split(data, "valid")
    X, groups = ctx.featurize(rows)
    assert pre.orders(X, groups, [row["user"] for row in rows]) != [row["prompt_order"] for row in rows]


def test_retrace_and_scan_copies_read_the_prompt_order(scored, tmp_path):
    from reranker.data.copy_warmup import build_copy_warmup
    from reranker.data.retrace import retrace_data, retrace_row

    data, r, items = scored
    for row in load_split(data, "train")[:50]:
        assert retrace_row(row, "scan_brand") == row  # the build's answers are the retrace's
    retrace_data(data, tmp_path / "top3", style="scan_brand_top3", progress=False)
    for row in load_split(tmp_path / "top3", "valid"):
        head = row["ranking"][:3]
        assert row["ranking"][3:] == [j for j in row["prompt_order"] if j not in head]
        assert "then the rest in scorer order" in row["reasoning"]
    out = build_copy_warmup(data, "copies.jsonl", seed=0, limit=20, trace_style="scan_brand", out_path=tmp_path / "c.jsonl")
    rows = load_split(data, "train")[:20]
    for rec, row in zip((json.loads(line) for line in out.read_text().splitlines()), rows):
        assert rec["prompt_messages"] == row["prompt_messages"] and rec["assistant"] == row["assistant"]


def test_scorer_order_needs_a_rule_trace(tmp_path):
    r, items = fake_retrieval(tmp_path)
    with pytest.raises(ValueError, match="candidate_order: scorer needs a rule trace style"):
        build_rerank_data(r, items, tmp_path / "data", n_selection_users=10, tokenizer_vocab=400,
                          trace_style="full", candidate_order="scorer")
    with pytest.raises(ValueError, match="candidate_order must be one of"):
        build_rerank_data(r, items, tmp_path / "data", n_selection_users=10, candidate_order="popularity")


def test_a_saved_preranker_round_trips_and_checks_its_files(scored, tmp_path):
    data, r, items = scored
    pre = PreRanker.load(data / "preranker")
    X = np.random.default_rng(0).random((10, N_FEATURES)).astype(np.float32)
    pre.save(tmp_path / "copy")
    again = PreRanker.load(tmp_path / "copy")
    assert np.allclose(again.full.predict(X), pre.full.predict(X))
    assert again.orders(X, [10], ["u001"], cross_fitted=True) == pre.orders(X, [10], ["u001"], cross_fitted=True)
    (tmp_path / "copy" / "preranker.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="field 'format'"):
        PreRanker.load(tmp_path / "copy")
    with pytest.raises(FileNotFoundError, match="preranker.json: missing"):
        PreRanker.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="needs the request's user"):
        pre.orders(X, [10], [None], cross_fitted=True)


@pytest.fixture(scope="module")
def tiny_model(scored, tmp_path_factory):
    from reranker.model import build_model, save_model
    from reranker.text.tokenizer import load_tokenizer

    data, r, items = scored
    tok = load_tokenizer(data / "tokenizer")
    model = build_model(len(tok), size="tiny", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    d = tmp_path_factory.mktemp("tiny") / "ar"
    save_model(model, tok, d)
    return d


def test_the_engine_renders_the_datas_prompts_and_falls_back_to_their_order(scored, tiny_model):
    from reranker.engine import DecodeOptions, RerankEngine, RerankRequest
    from reranker.eval.evaluate import check_list_orders, engine_for_split, request_of

    data, r, items = scored
    for split in ("valid", "test"):
        engine = engine_for_split(tiny_model, data, split)
        rows = load_split(data, split)[:12]
        assert [engine.prompt_messages(request_of(row)) for row in rows] == [row["prompt_messages"] for row in rows]
        check_list_orders(engine, rows, split)
        out = engine.rerank([request_of(row) for row in rows[:4]], DecodeOptions(decoder="ar", max_new_tokens=6))
        for res, row in zip(out, rows):  # an untrained model's answer is invalid: the prompt's order stands
            assert res.fallback and res.permutation == row["prompt_order"] == res.list_order
        from reranker.eval.evaluate import evaluate

        rep = evaluate(engine, rows, DecodeOptions(decoder="ar", max_new_tokens=6), progress=False)
        assert rep["copy_order_rate"] == 1.0  # every answer is the listed order: the pre-ranker's, not identity
        assert rep["vs_listed_order"]["recall@1"] == {"diff": 0.0, "ci_low": 0.0, "ci_high": 0.0}
        assert rep["listed_order"]["recall@1"] == rep["recall@1"]
    # the valid lists scored by the full model (which was fitted on them) are refused
    with pytest.raises(ValueError, match=r"valid\.jsonl:\d+: the engine lists the candidates as"):
        check_list_orders(RerankEngine.load(tiny_model, data), load_split(data, "valid"), str(data / "valid.jsonl"))
    row = load_split(data, "test")[0]
    with pytest.raises(ValueError, match="needs one score per candidate"):
        RerankEngine.load(tiny_model, data).prompt_ids(RerankRequest(row["history"], row["candidates"]))


def test_a_release_bundle_carries_the_full_preranker_and_its_counts(scored, tmp_path):
    from integration.release import _write_evidence
    from reranker.engine import RerankEngine, RerankRequest, read_train_sequences

    data, r, items = scored
    info = _write_evidence(data, tmp_path)
    assert info["candidate_order"] == "scorer" and info["artifacts"]["preranker"] == "preranker"
    assert info["evidence_files"]["train_sequences"] == "train_sequences.json.gz"
    pre = PreRanker.load(tmp_path / "preranker")
    assert pre.folds == [None, None]  # served requests are ordered by the full model alone
    seqs = read_train_sequences(tmp_path / "train_sequences.json.gz")
    assert seqs == {u: s[:-2] for u, s in json.loads((r / "sequences.json").read_text()).items()}
    _, meta = RerankEngine.load_evidence(tmp_path, info)
    bundle_pre, ctx = RerankEngine.load_preranker(tmp_path, info, meta)
    rows = load_split(data, "test")
    X, groups = ctx.featurize(rows)
    assert bundle_pre.orders(X, groups, [row["user"] for row in rows]) == [row["prompt_order"] for row in rows]
    before = (tmp_path / "train_sequences.json.gz").read_bytes()
    _write_evidence(data, tmp_path)
    assert (tmp_path / "train_sequences.json.gz").read_bytes() == before  # byte-identical: release.json's sha256
    (tmp_path / "train_sequences.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="train_sequences.json.gz: not gzipped JSON"):
        read_train_sequences(tmp_path / "train_sequences.json.gz")


def test_copy_drills_and_a_retraced_directory_keep_the_pre_rankers_order(scored, tiny_model, tmp_path):
    from reranker.data.copy_warmup import full_prompt_copy_example, reorder_for_uniform_pick
    from reranker.data.retrace import retrace_data
    from reranker.eval.evaluate import check_list_orders, engine_for_split
    import random

    data, r, items = scored
    row = load_split(data, "valid")[0]
    rec = full_prompt_copy_example(row, 2)  # "#3" is the prompt's third line: the pre-ranker's third
    shown = prompt_candidate_sids(_user(row))
    answer = json.loads(rec["assistant"].split("</think>\n")[1])["ranking"]
    assert answer == [shown[2]] + [s for k, s in enumerate(shown) if k != 2]
    assert rec["prompt_messages"][1]["content"].endswith("Put #3 first, then the rest in scorer order.")
    assert "then the rest in scorer order" in rec["assistant"]
    with pytest.raises(ValueError, match="uniform_pick shuffles a retriever-ordered prompt"):
        reorder_for_uniform_pick(row, "scan_brand", random.Random(0))
    retrace_data(data, tmp_path / "top3", style="scan_brand_top3", progress=False)  # carries preranker/ along
    valid = load_split(tmp_path / "top3", "valid")
    check_list_orders(engine_for_split(tiny_model, tmp_path / "top3", "valid"), valid, "top3/valid.jsonl")
    for row in valid:  # the decision numbers its pick as the prompt does
        pick = row["ranking"][0]
        assert f"#{row['prompt_order'].index(pick) + 1}.{row['candidate_sids'][pick]} first" in row["reasoning"]


def test_the_baselines_follow_build_info_not_a_leftover_directory(scored, tmp_path):
    import shutil

    from reranker.eval.baselines import learned_scorer

    data, r, items = scored
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    info = json.loads((copy / "build_info.json").read_text())
    ctx = _features(r, items)
    assert learned_scorer(copy, ctx).full.model_text() == PreRanker.load(data / "preranker").full.model_text()
    (copy / "build_info.json").write_text(json.dumps({**info, "candidate_order": "retriever"}))
    refit = learned_scorer(copy, ctx)  # fitted again from the lists, as for retriever-ordered data
    assert refit.full.info["fitted_lists"] == PreRanker.load(data / "preranker").full.info["fitted_lists"]
