"""`dgr2 e2e`: RecBole's Trainer.evaluate on SASRec alone vs SASRec + re-rankers (tiny data and models)."""
import json

import numpy as np
import pytest
import yaml

from candidate_gen.metrics import ndcg_at, recall_at, target_ranks
from candidate_gen.retrieve import run_retrieval
from integration.bench import recbole_section
from integration.cli import main
from integration.config import retrieval_settings
from integration.e2e import parse_reranker, run_e2e, sample_users
from reranker.data.dataset import build_rerank_data
from reranker.diffusion.convert import convert_to_diffusion
from reranker.training.init_model import init_model
from test_pipeline import TINY
from test_recbole_model import TINY_SASREC, ReverseEngine, run_snippet


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_catalog):
    """Retrieval artifacts, re-ranking data and tiny random AR + diffusion re-rankers for one config."""
    out = tmp_path_factory.mktemp("e2e") / "out"
    cfg = {"name": "tiny", "seed": 0, "out": str(out), "data": {"dir": str(tiny_catalog)},
           "retrieval": {"crossfit_folds": 0, "sasrec": TINY_SASREC},
           # 16 new tokens cannot hold a ranking of 10 items: every answer falls back (asserted below).
           "eval": {"max_new_tokens": 16}}
    rs = retrieval_settings(cfg, None, None)
    run_retrieval(rs)
    build_rerank_data(rs.out, tiny_catalog / "tiny.item", out / "rerank_data", n_selection_users=60,
                      tokenizer_vocab=500, max_train_examples=40)
    init_model(out / "rerank_data", out / "models" / "ar", size=TINY)
    convert_to_diffusion(out / "models" / "ar", out / "models" / "diff", block_size=8)
    return cfg, out


def faiss_metrics(out, users=None, reverse=False):
    """Recall@10 / NDCG@10 of the retrieval stage's own history-masked FAISS test lists."""
    rows = [json.loads(line) for line in (out / "retrieval" / "candidates" / "test.jsonl").open()]
    rows = [r for r in rows if users is None or r["user"] in set(users)]
    lists = [r["candidates"][::-1] if reverse else r["candidates"] for r in rows]
    ranks = target_ranks(lists, [r["target"] for r in rows])
    return len(rows), recall_at(ranks, 10), ndcg_at(ranks, 10)


def test_sasrec_alone_is_recbole_on_the_plain_wrapper(world):
    cfg, out = world
    res = run_e2e(cfg, [], None, seed=0, batch_size=8, tau=0.9, progress=False)
    (row,) = res["rows"]
    assert row["name"] == "SASRec alone" and row["decoder"] is None and row["seconds"] > 0
    plain = run_snippet(out / "retrieval")  # the README's RecBole evaluation, no re-ranker
    assert row["recall@10"] == pytest.approx(float(plain["recall@10"]), abs=1e-9)
    assert row["ndcg@10"] == pytest.approx(float(plain["ndcg@10"]), abs=1e-9)
    n, _, _ = faiss_metrics(out)
    assert res["n_users"] == res["n_users_total"] == n and res["user_sample_seed"] is None


def test_rerankers_on_a_seeded_user_sample(world, monkeypatch, tmp_path):
    cfg, out = world
    from reranker.engine import RerankEngine

    # A third "model" that reverses SASRec's top-10, to check the rewritten order and the counters,
    # and that the decode options reach the engine.
    load = RerankEngine.load
    reverse_dir = tmp_path / "reverse"
    reverse_dir.mkdir()
    reverse = ReverseEngine()
    monkeypatch.setattr(RerankEngine, "load", staticmethod(
        lambda model_dir, data: reverse if str(model_dir) == str(reverse_dir) else load(model_dir, data)))
    rerankers = [("AR GR2", str(out / "models" / "ar"), "ar"),
                 ("Diffusion-GR2", str(out / "models" / "diff"), "diffusion"),
                 ("reverse", str(reverse_dir), "diffusion")]
    res = run_e2e(cfg, rerankers, 40, seed=1, batch_size=8, tau=0.8, progress=False, commit_rule="prefix",
                  hold_eos=True)
    n_total, _, _ = faiss_metrics(out)
    assert (res["n_users"], res["n_users_total"], res["user_sample_seed"]) == (40, n_total, 1)
    alone, ar, diff, rev = res["rows"]
    assert [r["name"] for r in res["rows"]] == ["SASRec alone", "AR GR2", "Diffusion-GR2", "reverse"]
    assert (ar["decoder"], ar["tau"], diff["decoder"], diff["tau"]) == ("ar", None, "diffusion", 0.8)
    assert (ar["commit_rule"], diff["commit_rule"]) == (None, "prefix")
    assert (ar["hold_eos"], diff["hold_eos"]) == (None, True)
    opts = reverse.options
    assert (opts.decoder, opts.tau, opts.commit_rule, opts.hold_eos) == ("diffusion", 0.8, "prefix", True)

    # The sample is the full evaluation restricted to the sampled users: SASRec alone matches the
    # retrieval stage's own masked lists for exactly those users.
    test_rows = (out / "retrieval" / "candidates" / "test.jsonl").read_text().splitlines()
    users = sample_users([json.loads(line)["user"] for line in test_rows], 40, 1)
    n, recall, ndcg = faiss_metrics(out, users)
    assert n == 40
    assert alone["recall@10"] == pytest.approx(recall, abs=1e-4) and alone["ndcg@10"] == pytest.approx(ndcg, abs=1e-4)

    # Re-ordering within the top-10 never changes Recall@10.
    for row in (ar, diff, rev):
        assert row["recall@10"] == pytest.approx(alone["recall@10"], abs=1e-9)
        assert 0.0 <= row["ndcg@10"] <= 1.0 and row["seconds"] > 0
    # The random tiny models cannot answer in 16 tokens: every user falls back to SASRec's order.
    for row in (ar, diff):
        assert row["fallback_rate"] == 1.0 and row["users_reordered"] == 0
        assert row["ndcg@10"] == pytest.approx(alone["ndcg@10"], abs=1e-9)
    # The reversing engine re-orders every user, and RecBole scores the reversed order.
    assert rev["fallback_rate"] == 0.0 and rev["users_reordered"] == 40
    assert rev["ndcg@10"] == pytest.approx(faiss_metrics(out, users, reverse=True)[2], abs=1e-4)
    assert rev["ndcg@10"] != pytest.approx(alone["ndcg@10"], abs=1e-6)
    # Paired intervals against SASRec alone, from per-user ranks that reproduce RecBole's numbers.
    assert "vs_sasrec" not in alone
    for row in (ar, diff):  # all fallbacks: identical to SASRec alone, user by user
        assert row["vs_sasrec"]["ndcg@10"] == {"diff": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    v = rev["vs_sasrec"]["ndcg@10"]
    # RecBole rounds its metrics to 4 decimals.
    assert v["diff"] == pytest.approx(rev["ndcg@10"] - alone["ndcg@10"], abs=1e-4) and v["ci_low"] <= v["diff"] <= v["ci_high"]
    assert rev["vs_sasrec"]["recall@10"]["diff"] == pytest.approx(0.0, abs=1e-12)
    assert f"40 of {n_total} test users (a random sample, seed 1" in "\n".join(recbole_section("tiny", res))


def test_a_pre_ranked_run_gets_the_pre_rankers_own_row(world, tiny_catalog, tmp_path, monkeypatch):
    """Data built with a pre-ranker: its order alone is a row, and a model row whose every answer falls
    back gets exactly that row's order (the prompt's order), not SASRec's."""
    cfg, out = world
    out2 = tmp_path / "out"
    out2.mkdir()
    (out2 / "retrieval").symlink_to(out / "retrieval")
    build_rerank_data(out / "retrieval", tiny_catalog / "tiny.item", out2 / "rerank_data", n_selection_users=60,
                      tokenizer_vocab=500, max_train_examples=40, trace_style="scan_brand", candidate_order="scorer")
    init_model(out2 / "rerank_data", out2 / "models" / "ar", size=TINY)
    from reranker.engine import PreRankerOrder

    seen = {}
    rerank = PreRankerOrder.rerank

    def recorded(self, requests, options=None, prompts=None):
        out = rerank(self, requests, options, prompts)
        seen.update({(q.user, tuple(q.candidates)): r.list_order for q, r in zip(requests, out)})
        return out

    monkeypatch.setattr(PreRankerOrder, "rerank", recorded)
    res = run_e2e({**cfg, "out": str(out2)}, [("AR GR2", str(out2 / "models" / "ar"), "ar")], 40, seed=1,
                  batch_size=8, tau=None, progress=False)
    # RecBole's users get the pre-ranker's order of the data build's test lists (whole histories,
    # stored scores): the same features, so the same order, wherever the list is one of them
    rows = [json.loads(line) for line in (out2 / "rerank_data" / "test.jsonl").read_text().splitlines()]
    same = [(r["user"], tuple(r["candidates"])) for r in rows if (r["user"], tuple(r["candidates"])) in seen]
    assert len(same) >= 5
    assert all(seen[k] == r["prompt_order"] for r in rows for k in [(r["user"], tuple(r["candidates"]))] if k in seen)
    alone, pre, ar = res["rows"]
    assert [r["name"] for r in res["rows"]] == ["SASRec alone", "SASRec + pre-ranker", "AR GR2"]
    assert pre["model_dir"] == "rerank_data/preranker" and pre["fallback_rate"] == 0.0
    assert pre["users_reordered"] > 0 and pre["users_with_recbole_history"] == 0
    assert ar["fallback_rate"] == 1.0 and ar["ndcg@10"] == pytest.approx(pre["ndcg@10"], abs=1e-9)
    assert ar["vs_sasrec"]["ndcg@10"] == pre["vs_sasrec"]["ndcg@10"]
    with pytest.raises(ValueError, match="the pre-ranker's own row"):
        run_e2e({**cfg, "out": str(out2)}, [("SASRec + pre-ranker", str(out2 / "models" / "ar"), "ar")], 5, 0, 8,
                None, progress=False)


def test_user_sample_is_seeded():
    users = [f"u{k}" for k in range(100)]
    a = sample_users(users, 10, 0)
    assert len(a) == 10 and len(set(a)) == 10 and set(a) <= set(users)
    assert list(a) == list(sample_users(users[::-1], 10, 0))  # the order given does not matter
    assert list(a) != list(sample_users(users, 10, 1))
    assert list(sample_users(users, None, 0)) == sorted(users) == list(sample_users(users, 500, 0))
    with pytest.raises(ValueError, match="--users"):
        sample_users(users, 0, 0)


def test_bad_input_is_named(world, tmp_path, capsys):
    cfg, out = world
    assert parse_reranker("AR GR2=runs/a:b/final:ar") == ("AR GR2", "runs/a:b/final", "ar")
    for bad in ["no-equals-sign", "X=dir", "X=dir:beam", "=dir:ar", "X=:ar"]:
        with pytest.raises(ValueError, match="--reranker"):
            parse_reranker(bad)
    with pytest.raises(FileNotFoundError, match="'gone'.*not found"):
        run_e2e(cfg, [("gone", str(tmp_path / "missing"), "ar")], 5, 0, 8, 0.9, progress=False)
    empty = {"name": "empty", "out": str(tmp_path / "empty")}
    with pytest.raises(FileNotFoundError, match=r"sasrec\.safetensors.*dgr2 retrieve --config configs/empty\.yaml"):
        run_e2e(empty, [], None, 0, 8, 0.9, progress=False)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["e2e", "--config", str(path), "--reranker", "X=dir:beam"]) == 2
    assert "'X=dir:beam'" in capsys.readouterr().err
    # The command end to end, SASRec alone on a sample: the table and the results file.
    res_path = tmp_path / "recbole-e2e-tiny.json"
    assert main(["e2e", "--config", str(path), "--users", "5", "--seed", "3", "--out", str(res_path)]) == 0
    assert "SASRec alone" in capsys.readouterr().out
    doc = json.loads(res_path.read_text())
    assert {"command", "commit", "date"} <= set(doc)
    assert (doc["n_users"], doc["user_sample_seed"], len(doc["rows"])) == (5, 3, 1)
    assert np.isfinite(doc["rows"][0]["ndcg@10"])
    # --run reads a `dgr2 pipeline --out` directory in place of the config's out.
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(yaml.safe_dump({**cfg, "out": str(tmp_path / "not-here")}))
    assert main(["e2e", "--config", str(elsewhere), "--users", "5", "--seed", "3"]) == 2
    assert "sasrec.safetensors" in capsys.readouterr().err
    assert main(["e2e", "--config", str(elsewhere), "--run", str(out), "--users", "5", "--seed", "3",
                 "--out", str(res_path)]) == 0
    assert json.loads(res_path.read_text())["rows"][0]["ndcg@10"] == doc["rows"][0]["ndcg@10"]


def test_merge_into_adds_rows_only_for_the_same_users():
    from integration.e2e import merge_into

    base = {"name": "SASRec alone", "recall@10": 0.1, "ndcg@10": 0.05}
    old = {"dataset": "d", "n_users": 5, "n_users_total": 9, "user_sample_seed": 0, "history_masked": True,
           "command": "dgr2 e2e a", "rows": [base, {"name": "AR", "recall@10": 0.1, "ndcg@10": 0.06}]}
    new = {**old, "command": "dgr2 e2e b", "rows": [dict(base), {"name": "Diffusion", "recall@10": 0.1, "ndcg@10": 0.07}]}
    merged = merge_into(old, new)
    assert [r["name"] for r in merged["rows"]] == ["SASRec alone", "AR", "Diffusion"]
    with pytest.raises(ValueError, match="n_users"):
        merge_into(old, {**new, "n_users": 6})
    with pytest.raises(ValueError, match="SASRec alone ndcg@10"):
        merge_into(old, {**new, "rows": [{**base, "ndcg@10": 0.051}]})
