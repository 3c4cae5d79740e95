"""`dgr2 report`: AR report against the baselines and the stage table, from eval reports' ranks."""

import json

import numpy as np
import pytest

from integration import report as R
from reranker.eval.baselines import baseline_ranks
from tests.reranker.eval.test_baselines import N_USERS, TEST_RANK, built  # noqa: F401  (module fixture)


def _eval(tmp_path, name, ranks, tps=100.0, decoder="ar", n=None):
    from reranker.eval.metrics import compare, summarize

    ranks = np.asarray(ranks)
    floor = np.full(len(ranks), TEST_RANK)
    rep = {"n": len(ranks) if n is None else n, "split": "test", "decoder": decoder, "tau": 0.9, "block_size": 32,
           **summarize(ranks), "valid_rate": 1.0, "tokens_per_second": tps, "retriever": summarize(floor),
           "vs_retriever": compare(floor, ranks, n_boot=100), "ranks": ranks.tolist()}
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(rep))
    return p


def test_ar_report_compares_with_every_baseline_on_the_same_users(built, tmp_path):  # noqa: F811
    data, _, _ = built
    base = baseline_ranks(data)
    assert set(base) == {"retriever", "random", "copurchase_last", "copurchase_recent_brand",
                         "copurchase_recent_brand_pick", "learned_scorer"}
    assert (base["retriever"] == TEST_RANK).all()
    perfect = _eval(tmp_path, "ar", np.zeros(N_USERS, int))
    before = _eval(tmp_path, "sft", base["copurchase_last"])
    rep = R.ar_report(R.load_report(perfect), data, R.load_report(before), n_boot=200)
    for name in base:
        d = rep["vs_baselines"][name]["recall@1"]
        assert d["diff"] == pytest.approx(1 - rep["baselines"][name]["recall@1"])
    assert rep["vs_baselines"]["retriever"]["recall@1"]["ci_low"] == pytest.approx(1.0)
    assert rep["vs_before_last_stage"]["recall@1"]["diff"] >= 0
    json.dumps(rep)


def test_ar_report_refuses_a_subset_of_users(built, tmp_path):  # noqa: F811
    data, _, _ = built
    with pytest.raises(ValueError, match="users"):
        R.ar_report(R.load_report(_eval(tmp_path, "ar", np.zeros(N_USERS - 3, int))), data)


def test_stage_table_rows_carry_ci_and_speedup_against_the_reference(tmp_path):
    rng = np.random.default_rng(0)
    ar = rng.integers(0, 10, 300)
    worse = np.minimum(ar + 1, 9)
    rows = [("AR GR2", R.load_report(_eval(tmp_path, "ar", ar, tps=100))),
            ("+CFT", R.load_report(_eval(tmp_path, "cft", worse, tps=350, decoder="diffusion")))]
    rep = R.stages_report(rows, ablations=[("same", R.load_report(_eval(tmp_path, "same", ar, tps=50)))], n_boot=200)
    assert [r["name"] for r in rep["rows"]] == ["retriever order", "AR GR2", "+CFT"]
    cft = rep["rows"][2]
    assert cft["speedup_vs_ar"] == pytest.approx(3.5) and cft["vs_ar"]["ndcg@3"]["ci_high"] < 0
    assert "vs_ar" not in rep["rows"][1]
    assert rep["ablations"][0]["vs_ar"]["recall@1"]["diff"] == 0
    assert rep["tau"] == 0.9 and rep["test_users"] == 300


def test_stage_table_errors_name_the_problem(tmp_path):
    a = R.load_report(_eval(tmp_path, "a", np.zeros(10, int)))
    b = R.load_report(_eval(tmp_path, "b", np.zeros(12, int)))
    with pytest.raises(ValueError, match="same test users"):
        R.stages_report([("AR GR2", a), ("x", b)])
    with pytest.raises(ValueError, match="reference row"):
        R.stages_report([("x", a)])
    with pytest.raises(ValueError, match="LABEL=PATH"):
        R.parse_pairs(["nolabel"], "--row")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="ranks"):
        R.load_report(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="dgr2 eval"):
        R.load_report(tmp_path / "missing.json")


def test_training_curves_from_metrics_logs_and_their_plot(tmp_path):
    from integration.bench import Ctx, curves_section

    run = tmp_path / "runs" / "opd"
    run.mkdir(parents=True)
    rows = [{"kind": "data", "step": 0, "train_prompts": 5},
            {"kind": "train", "step": 1, "kl": 0.9, "lr": 1e-4, "epoch": 0},
            {"kind": "train", "step": 2, "kl": 0.5, "lr": 1e-4, "epoch": 0},
            {"kind": "valid", "step": 2, "kl": 0.6, "valid_rate": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = R.training_curves([("opd", str(run))])
    assert doc["runs"]["opd"]["train"]["kl"] == [[1, 0.9], [2, 0.5]] and "lr" not in doc["runs"]["opd"]["train"]
    lines = curves_section("x", doc, Ctx(tmp_path / "plots", tmp_path))
    assert any("| opd (train) | kl | 0.9000 | 0.5000 | 2 |" in ln for ln in lines), lines
    assert (tmp_path / "plots" / "curves-x.png").stat().st_size > 1000
    (run / "metrics.jsonl").write_text("{oops\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        R.training_curves([("opd", str(run))])


def test_ar_report_keeps_the_eval_provenance_apart(built, tmp_path):  # noqa: F811
    from integration.bench import provenance

    data, _, _ = built
    p = _eval(tmp_path, "ar", np.zeros(N_USERS, int))
    doc = json.loads(p.read_text())
    p.write_text(json.dumps({**doc, "command": "dgr2 eval --model M", "commit": "abc", "date": "d"}))
    rep = R.ar_report(R.load_report(p), data, n_boot=50)
    assert "command" not in rep and rep["eval_command"] == "dgr2 eval --model M" and rep["eval_commit"] == "abc"
    line = provenance({**rep, "command": "dgr2 report ar", "commit": "def"})
    assert "`dgr2 report ar`" in line and "Evaluated by `dgr2 eval --model M`" in line


def test_stage_summary_plot(tmp_path):
    from integration.plots import plot_stage_summary

    rows = [{"name": "retriever order", "recall@1": 0.2}, {"name": "AR GR2", "recall@1": 0.3, "tokens_per_second": 50.0}]
    png = plot_stage_summary({"rows": rows}, tmp_path / "p" / "stages.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert plot_stage_summary({"rows": []}, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
