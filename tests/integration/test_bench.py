"""`dgr2 bench` renders every section from small fake result files (a renderer test: the numbers are
fixtures, never reported anywhere) and says "not measured yet" for missing ones."""
import json

from integration.bench import SECTIONS, build_benchmarks
from reranker.eval.speed import speedup_ceiling


def prov(**kw):
    return {"command": "dgr2 fake --x", "commit": "abc1234", "date": "2025-01-01 00:00 UTC", **kw}


def ci(d):
    return {"diff": d, "ci_low": d - 0.01, "ci_high": d + 0.01}


def st(m):
    return {"median": m, "min": m * 0.9, "max": m * 1.1, "q1": m * 0.95, "q3": m * 1.05, "n": 5, "values": [m] * 5}


def eval_report(decoder, r1):
    m = {"recall@1": r1, "recall@3": 0.6, "ndcg@3": 0.45, "ndcg@5": 0.5}
    return prov(n=10, decoder=decoder, tau=0.9, block_size=32, split="test", **m, valid_rate=1.0, fallback_rate=0.0,
                copy_order_rate=0.1, failures={"unparsable": 0}, mean_generated_tokens=100.0, tokens_per_second=50.0,
                forward_passes_per_token=1.0, retriever={k: 0.3 for k in m}, vs_retriever={k: ci(0.02) for k in m},
                stage_seconds={"sft": 12.0})


def speed_doc():
    pt = lambda tau, sp, r1: {"tau": tau, "tokens_per_second": st(100 * sp), "forward_passes_per_token": 1 / sp,
                              "tokens_per_step": sp, "mean_generated_tokens": 120.0, "speedup": sp,
                              "speedup_paired": st(sp), "same_tokens_as_ar": 0.5, "recall@1": r1, "valid_rate": 0.99}
    ar = {"tokens_per_second": st(100.0), "forward_passes_per_token": 1.0, "mean_generated_tokens": 120.0,
          "recall@1": 0.33, "valid_rate": 1.0}
    batches = [{"batch_size": b, "ar": ar, "points": [pt(1.0, 0.8, 0.33), pt(0.9, 2.5, 0.32), pt(0.4, 3.9, 0.3)]}
               for b in (1, 8)]
    curve = [{"length": L, "batch_size": 1, "ar": ar, "points": [pt(0.9, 2.0 + L / 256, None), pt(1.0, 0.8, None)]}
             for L in (64, 128, 256)]
    fwd = {"context": 600, "iters": 20, "rows": [{"batch_size": b, "one_token_ms": st(3.2), "blocks": [
        {"block_size": s, "ms": st(3.2 * r), "ratio": r} for s, r in ((8, 1.37), (16, 1.57), (32, 1.9))]}
        for b in (1, 8)]}
    acc = {"n": 10, "split": "test", "ar": {"recall@1": 0.33},
           "diffusion": [{"tau": t, "recall@1": 0.3, "vs_ar": {"recall@1": ci(-0.01)}} for t in (1.0, 0.9, 0.4)]}
    return prov(kind="diffusion-speed", machine={"cpu_count": 2, "torch_threads": 2, "torch_version": "2.x",
                                                 "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 1, 1]},
                settings={"block_size": 32, "max_new_tokens": 320, "repeats": 5, "warmup": 1, "n_prompts": 8,
                          "mean_prompt_tokens": 500.0}, batches=batches, length_curve=curve, forward_cost=fwd,
                accuracy=acc)


def forward_cost_doc():
    fc = {"context": 403, "iters": 20, "rows": [{"batch_size": b, "one_token_ms": st(2.0 * b), "blocks": [
        {"block_size": 32, "ms": st(8.0 * b), "ratio": 4.0, "fused_ms": st(16.0 * b), "fused_ratio": 8.0}]}
        for b in (1, 8)]}
    return prov(kind="forward-cost", machine={"cpu_count": 2, "torch_threads": 2}, settings={"model": "random cpu"},
                forward_cost=fc, ceiling=speedup_ceiling(fc, 64))


def fake_results():
    rows = [dict(name=n, **{"recall@1": r, "recall@3": 0.6, "ndcg@3": 0.45}, valid_rate=v, tokens_per_second=t,
                 speedup_vs_ar=s, vs_ar={"recall@1": ci(r - 0.33)} if n != "AR GR2" else None)
            for n, r, v, t, s in [("retriever", 0.30, None, None, None), ("AR GR2", 0.33, 1.0, 40.0, 1.0),
                                  ("naive conversion", 0.29, 0.001, 90.0, 2.2), ("+CFT", 0.325, 0.996, 130.0, 3.2),
                                  ("+CFT+OPD", 0.33, 0.998, 140.0, 3.5), ("+CFT+OPD+RL", 0.334, 0.999, 141.0, 3.5)]]
    return {
        "retrieval-tiny": prov(dataset="tiny", users=300, items=50, interactions=3000, **{"recall@10": 0.1}),
        "rerank-baselines-tiny": {"test_users": 10, "n_candidates": 10, "methods": {  # no provenance keys: lenient
            "retriever": {"metrics": {"recall@1": 0.3, "recall@3": 0.5, "ndcg@3": 0.4, "ndcg@5": 0.45}, "vs_retriever": None},
            "copurchase_last": {"metrics": {"recall@1": 0.34, "recall@3": 0.55, "ndcg@3": 0.44, "ndcg@5": 0.47},
                                "vs_retriever": {k: ci(0.04) for k in ("recall@1", "recall@3", "ndcg@3", "ndcg@5")}}}},
        "rerank-ar-tiny": eval_report("ar", 0.3301),
        "rerank-student-bundle-tiny": eval_report("diffusion", 0.3299),
        "pipeline-tiny": prov(stage_seconds={"retrieval": 12.0, "sft": 30.5}, total_seconds=42.5, resumed=True,
                              invocations=[{"commit": "abc1234"}, {"commit": "abc1234"}]),
        "diffusion-cft-tiny": eval_report("diffusion", 0.3202),
        "stages-tiny": prov(test_users=10, tau=0.9, block_size=32, rows=rows, ablations=rows[4:5]),
        "diffusion-speed-tiny": speed_doc(),
        "forward-cost-tiny": forward_cost_doc(),
        "train-cost-tiny": prov(kind="train-cost", model="random tiny", batch_size=2, length=8, iters=5,
                                rows=[{"autocast": "none", "seconds": st(1.0)}, {"autocast": "bf16", "seconds": st(0.5)}],
                                speedup=2.0),
        "service-load": prov(runs=[{"concurrency": c, "options": {"decoder": d}, "qps": q * c, "ok": 100,
                                    "errors": {}, "latency_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0},
                                    "mean_batch_size": 2.0, "fallback_rate": 0.0}
                                   for d, q in (("ar", 1.0), ("diffusion", 3.0)) for c in (1, 8, 32)],
                             diffusion_over_ar_qps={"1": 3.0, "8": 3.0, "32": 3.0}),
        "service-overload": prov(overload={
            "calls_per_method": 400, "rate_per_s": 200.0, "refusal_p99_ms": {"Rerank": 2.4},
            "Rerank": {"codes": {"OK": 40, "RESOURCE_EXHAUSTED": 360}, "refusal_ms": {"p50": 1.4, "p99": 2.4},
                       "ok_ms": {"p50": 7862.0}, "send_lag_ms": {"p99": 1.8}}}),
        "recbole-e2e-tiny": prov(dataset="tiny", history_masked=True, n_users=300, rows=[
            {"name": "SASRec alone", "recall@10": 0.0812, "ndcg@10": 0.0401},
            {"name": "SASRec + Diffusion-GR2", "tau": 0.9, "recall@10": 0.0812, "ndcg@10": 0.0452, "seconds": 12.5,
             "vs_sasrec": {"ndcg@10": {"diff": 0.0051, "ci_low": 0.0010, "ci_high": 0.0090}}}]),
        "curves-tiny": prov(runs={"opd": {"train": {"kl": [[1, 0.9], [2, 0.5]]}, "valid": {"kl": [[2, 0.6]]}},
                                  "rl": {"train": {"reward_mean": [[1, 0.1], [2, 0.3]]}, "valid": {}}}),
        "sid-copy-tiny": prov(rows=[{"model": "m", "file": "f", "examples": 4, "by_level": {"a": 0.5, "b": 0.25}},
                                    {"model": "m2", "file": "f", "examples": 4, "by_level": {"a": 1.0, "b": 0.5},
                                     "by_prefix": {"b": {"shared": {"accuracy": 0.25, "tokens": 8},
                                                         "unique": {"accuracy": 0.75, "tokens": 8}}},
                                     "errors": {"other_candidate": 7, "context": 1, "invented": 0},
                                     "greedy": {"valid_rate": 0.25, "exact_rate": 0.0, "examples": 4}}]),
        "something-else": prov(x=1),
    }


def write(d, results):
    d.mkdir(parents=True, exist_ok=True)
    for name, doc in results.items():
        (d / f"{name}.json").write_text(json.dumps(doc))


def test_every_section_renders_with_provenance_and_plots(tmp_path):
    write(tmp_path / "results", fake_results())
    out = build_benchmarks(tmp_path / "results", tmp_path / "docs" / "BENCHMARKS.md", tmp_path / "docs" / "plots")
    md = out.read_text()
    assert "Not measured yet" not in md and "Could not render" not in md
    for sec in SECTIONS:
        assert f"## {sec.title}" in md
    # sections follow the data flow: retrieval first, the AR teacher before the diffusion stages, speed,
    # the service, then RecBole end to end
    titles = ["Retrieval", "Re-ranking baselines", "AR re-ranker", "Stage table", "Decode speed", "Service load",
              "RecBole end to end"]
    assert [md.index(f"## {t}") for t in titles] == sorted(md.index(f"## {t}") for t in titles)
    assert "Superseded runs" not in md  # no archive, no link
    assert md.count("commit `abc1234`") >= 13 and "dgr2 fake --x" in md
    assert "Command: not recorded" in md  # the baselines file carries no provenance
    assert "+CFT+OPD+RL" in md and "0.3340 (+0.0040 [-0.0060, +0.0140])" in md  # stage cell with CI vs AR
    assert "0.3301" in md and "0.3202" in md and "| sft | 12 |" in md
    assert "2.50 [2.25–2.75]" in md  # speed-up per repeat: median [min–max]
    assert "1.90× (6.08 [5.47–6.69] ms)" in md  # forward-cost ratio
    # 64 tokens = 2 blocks: one step (8) + one fused step (16) against 64 one-token steps (128); s = 2 adds 2 x 8
    assert "| bf16 | 0.500 [0.450–0.550] |" in md and "**2.00×**" in md
    assert "4.00× / 8.00× → **5.33× / 3.20×**" in md and "| 8 | 2 | 3.20× | 1, 32 | 1 |" in md
    assert "SASRec + Diffusion-GR2 (τ = 0.9)" in md and "0.0452 (+0.0051 [+0.0010, +0.0090])" in md
    assert "`something-else.json`" in md
    assert "sent at 200 a second (open loop)" in md
    assert "| Rerank | OK 40, RESOURCE_EXHAUSTED 360 | 1.4 | 2.4 | 7862.0 | 1.8 |" in md
    plots = tmp_path / "docs" / "plots"
    assert "| `m` | `f` | 4 | 0.500 | 0.250 |" in md
    assert "| `m2` | `f` | b 0.250 / 0.750 | 7 / 1 / 0 | 0.250 |" in md
    assert "| rl (train) | reward_mean | 0.1000 | 0.3000 | 2 |" in md
    for png in ("curves-tiny.png", "tau-frontier-tiny.png", "speedup-length-tiny.png", "speedup-batch-tiny.png", "service-load.png"):
        data = (plots / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"](plots/{png})" in md  # linked relative to the page


def test_missing_results_say_not_measured_yet(tmp_path):
    res = fake_results()
    write(tmp_path / "results", {"retrieval-tiny": res["retrieval-tiny"]})
    md = build_benchmarks(tmp_path / "results", tmp_path / "BENCHMARKS.md", tmp_path / "plots").read_text()
    assert md.count("Not measured yet") == len(SECTIONS) - 1
    assert "`dgr2 speed --ar <ar_dir>" in md and "`dgr2 loadtest" in md
    assert not (tmp_path / "plots").exists()  # nothing to plot, nothing written
    # an empty results directory still yields a page
    md = build_benchmarks(tmp_path / "none", tmp_path / "B2.md").read_text()
    assert md.count("Not measured yet") == len(SECTIONS)


def test_partial_and_malformed_files(tmp_path):
    doc = speed_doc()
    doc.pop("accuracy")
    doc.pop("length_curve")
    doc.pop("forward_cost")
    for row in doc["batches"]:
        for p in [row["ar"], *row["points"]]:
            p.pop("recall@1", None)
    write(tmp_path / "results", {"diffusion-speed-x": doc, "stages-bad": prov(rows="oops")})
    md = build_benchmarks(tmp_path / "results", tmp_path / "BENCHMARKS.md", tmp_path / "plots").read_text()
    assert "has no accuracy per τ" in md and "Speed-up vs output length: not measured" in md
    assert "Could not render `stages-bad.json`" in md
    assert (tmp_path / "plots" / "speedup-batch-x.png").exists()
    assert not (tmp_path / "plots" / "tau-frontier-x.png").exists()


def test_superseded_runs_get_their_own_page_oldest_first(tmp_path):
    res = fake_results()
    results = tmp_path / "results"
    write(results, {"stages-tiny": res["stages-tiny"], "stages-tiny-ablations": res["stages-tiny"]})
    write(results / "archive", {"stages-tiny-b": dict(res["stages-tiny"], date="2024-06-01 00:00 UTC"),
                                "stages-tiny-c": dict(res["stages-tiny"], date="2024-01-01 00:00 UTC"),
                                "diffusion-speed-tiny-old": res["diffusion-speed-tiny"]})
    md = build_benchmarks(results, tmp_path / "docs" / "BENCHMARKS.md", tmp_path / "docs" / "plots").read_text()
    assert "tiny-b" not in md and "tiny-old" not in md
    assert md.index("### tiny\n") < md.index("### tiny-ablations")  # the main file before its variants
    assert "](../results/archive/BENCHMARKS.md)" in md  # linked at the end of the main page
    page = (results / "archive" / "BENCHMARKS.md").read_text()
    assert "](../../docs/BENCHMARKS.md)" in page
    assert "Not measured yet" not in page and "## Retrieval" not in page  # only sections with archived files
    assert page.index("### tiny-c") < page.index("### tiny-b")  # by recorded date, not by name
    assert (results / "archive" / "plots" / "speedup-batch-tiny-old.png").exists()
    assert not (tmp_path / "docs" / "plots" / "speedup-batch-tiny-old.png").exists()


def test_a_replaced_result_moves_to_the_archive_under_its_recorded_date(tmp_path):
    import pytest

    from integration.bench import archive_result

    results = tmp_path / "results"
    results.mkdir()
    old = results / "stages-tiny.json"
    old.write_text(json.dumps(prov(rows=[]) | {"date": "2026-12-01 17:43 UTC"}))
    moved = archive_result(old)
    assert moved == results / "archive" / "stages-tiny-2026-12-01-1743.json" and moved.is_file() and not old.exists()
    old.write_text(moved.read_text())  # the same run again: its archive name is taken
    with pytest.raises(FileExistsError, match="stages-tiny-2026-12-01-1743.json exists"):
        archive_result(old)
    undated = results / "stages-undated.json"
    undated.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="stages-undated.json: its 'date' is None"):
        archive_result(undated)
    assert old.exists() and undated.exists()  # a refused file stays where it was
