"""Speed harness (reranker/eval/speed.py) on tiny random models: every field present, exact counting."""
import json

import numpy as np
import pytest
import torch

from reranker.diffusion.convert import convert_to_diffusion, load_diffusion_config
from reranker.model import SIZES, build_model, save_model
from reranker.text.prompt import render_assistant
from reranker.text.sid import build_semantic_ids
from reranker.eval.speed import (NO_EOS, format_forward_cost, format_speed, forward_cost, measure_speed, run_forward_cost,
                            run_speed_benchmark, speedup_ceiling, stats)
from reranker.text.tokenizer import build_tokenizer

torch.set_num_threads(1)
ITEMS = [f"it{k}" for k in range(24)]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """ar/ (tiny random Qwen3 + tokenizer), diff/ (its conversion, B = 4) and data/ (sids, build_info,
    test.jsonl) with the retrieval/ and items file they point to: everything RerankEngine.load reads."""
    d = tmp_path_factory.mktemp("speed")
    rng = np.random.default_rng(0)
    rows = ["item_id:token\ttitle:token_seq\tbrand:token\tcategories:token_seq"]
    rows += [f"{it}\tThing {k}\tBrand{k % 5}\tBeauty Leaf{k % 7}" for k, it in enumerate(ITEMS)]
    (d / "items.item").write_text("\n".join(rows) + "\n")
    seqs = {f"u{u}": [ITEMS[(u + 3 * k) % 24] for k in range(5)] for u in range(10)}
    (d / "retrieval").mkdir()
    (d / "retrieval" / "sequences.json").write_text(json.dumps(seqs))
    sids = build_semantic_ids(rng.normal(size=(24, 8)).astype(np.float32), ITEMS, codebook_size=4)
    (d / "data").mkdir()
    sids.save(d / "data" / "sids.json")
    (d / "data" / "build_info.json").write_text(json.dumps({
        "retrieval_dir": "../retrieval", "items_path": "../items.item", "copurchase_window": 1, "profile": "cpu",
        "max_prompt_tokens": 4096}))
    examples = [{"history": ITEMS[k:k + 2], "candidates": ITEMS[8 + k:12 + k], "target_index": k % 4,
                 "user": f"u{k}"} for k in range(2)]
    (d / "data" / "test.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    corpus = [render_assistant("brand match", [sids.sid_string(i) for i in ITEMS[:5]])] * 5
    tok = build_tokenizer(corpus + [f"History Candidates brand {t}" for t in ITEMS], vocab_size=300)
    # a larger init makes the random model's distributions peaked: no near-ties in greedy comparisons
    model = build_model(len(tok), dict(SIZES["tiny"], initializer_range=0.3), pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, seed=0).eval()
    save_model(model, tok, d / "ar")
    dmodel, _ = convert_to_diffusion(d / "ar", d / "diff", block_size=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 250, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    return dict(root=d, model=model, dmodel=dmodel.eval(), prompts=prompts)


def test_stats():
    s = stats([3.0, 1.0, 2.0, 10.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3.0, 1.0, 10.0, 2.0, 4.0, 5)
    assert stats([])["median"] is None


def test_measure_speed_reports_every_field(parts):
    rep = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], batch_sizes=(1, 2), taus=(1.0, 0.5),
                        max_new_tokens=8, repeats=3, warmup=1, threads=1, lengths=(8, 12), length_taus=(0.9,),
                        length_batch_sizes=(2,), forward_blocks=(2, 4), forward_iters=3)
    json.dumps(rep)  # serialisable as is
    m = rep["machine"]
    assert m["torch_threads"] == 1 and m["cpu_count"] >= 1 and m["torch_version"] == torch.__version__
    assert "load_average_start" in m and "load_average_end" in m
    assert rep["settings"]["block_size"] == 4 and rep["settings"]["repeats"] == 3
    assert [r["batch_size"] for r in rep["batches"]] == [1, 2]
    for row in rep["batches"]:
        ar = row["ar"]
        assert ar["tokens_per_second"]["n"] == 3 and ar["tokens_per_second"]["median"] > 0
        assert ar["deterministic"] and ar["forward_passes_per_token"] >= 1.0
        assert [p["tau"] for p in row["points"]] == [1.0, 0.5]
        for p in row["points"]:
            assert p["tokens_per_second"]["median"] > 0 and p["tokens_per_step"] >= 1.0
            assert p["speedup"] == pytest.approx(p["tokens_per_second"]["median"] / ar["tokens_per_second"]["median"])
            sp = p["speedup_paired"]
            assert sp["n"] == 3 and sp["min"] <= sp["median"] <= sp["max"]
            dec = ar["decode_tokens_per_second"]["median"]
            assert p["decode_speedup"] == pytest.approx(p["decode_tokens_per_second"]["median"] / dec)
            assert p["decode_speedup_paired"]["n"] == 3
            assert 0 < p["prefill_seconds"]["median"] < p["seconds"]["median"]
            assert 0.0 <= p["same_tokens_as_ar"] <= 1.0 and p["deterministic"]
    # output-length curve: EOS disabled, exactly L tokens per row for both decoders
    assert [(r["length"], r["batch_size"]) for r in rep["length_curve"]] == [(8, 2), (12, 2)]
    for r in rep["length_curve"]:
        n = len(parts["prompts"])
        assert r["ar"]["generated_tokens"] == n * r["length"]
        assert r["ar"]["forward_passes_per_token"] == pytest.approx(1.0)  # prefill yields the first token
        assert r["points"][0]["generated_tokens"] == n * r["length"]
    fc = rep["forward_cost"]
    assert fc["context"] == round(np.mean([len(p) for p in parts["prompts"]]))
    assert [r["batch_size"] for r in fc["rows"]] == [1, 2]
    assert all([b["block_size"] for b in r["blocks"]] == [2, 4] and all(b["ratio"] > 0 for b in r["blocks"])
               for r in fc["rows"])
    assert rep["accuracy"] is None
    assert "speed-up" in format_speed(rep)


def test_tau_one_block_one_reproduces_ar_and_counts_passes(parts):
    L = 10
    rep = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], batch_sizes=(1,), taus=(1.0,), block_size=1,
                        max_new_tokens=L, repeats=1, warmup=0, eos_token_id=NO_EOS, lengths=(), forward_blocks=())
    ar, p = rep["batches"][0]["ar"], rep["batches"][0]["points"][0]
    assert p["same_tokens_as_ar"] == 1.0
    assert ar["forward_passes_per_token"] == pytest.approx(1.0)
    # the diffusion prefill covers the prompt but its last column and yields no token: one extra pass
    assert p["forward_passes_per_token"] == pytest.approx((L + 1) / L)
    assert p["tokens_per_step"] == 1.0


def test_decode_phase_leaves_out_the_prefill_and_its_tokens(parts):
    from reranker.eval.speed import _run

    prompts = parts["prompts"]
    for kind, model, first in (("ar", parts["model"], 1), ("diffusion", parts["dmodel"], 0)):
        r = _run(kind, model, prompts, 2, 6, NO_EOS, 0, tau=0.9, block_size=4,
                 mask_token_id=load_diffusion_config(parts["dmodel"])["mask_token_id"])
        assert r["generated_tokens"] == 6 * len(prompts)
        assert 0 < r["prefill_seconds"] < r["seconds"]
        # AR's prefill already yields each row's first token; the diffusion prefill yields none
        want = (6 - first) * len(prompts) / (r["seconds"] - r["prefill_seconds"])
        assert r["decode_tokens_per_second"] == pytest.approx(want)


def test_run_speed_benchmark_writes_result_with_accuracy(parts, tmp_path, monkeypatch):
    import candidate_gen.files as files

    monkeypatch.setattr(files, "current_commit", lambda: "abc1234")
    d = parts["root"]
    out = tmp_path / "results" / "diffusion-speed-tiny.json"
    doc = run_speed_benchmark(d / "ar", d / "diff", d / "data", out, n_prompts=2, batch_sizes=(1, 2),
                              taus=(0.9, 1.0), max_new_tokens=6, repeats=1, warmup=0, lengths=(8,),
                              length_taus=(0.9,), length_batch_sizes=(1,), forward_blocks=(4,), forward_iters=2,
                              accuracy_batch_size=2)
    text = out.read_text()
    saved = json.loads(text)
    assert saved == doc
    assert str(tmp_path) not in text and str(d) not in text  # no absolute paths of this machine
    assert saved["command"].startswith("dgr2 speed --ar ar --diffusion diff --data data --out ")
    assert saved["commit"] == "abc1234" and saved["date"]
    assert saved["models"] == {"ar": "ar", "diffusion": "diff", "data": "data", "split": "test"}
    assert saved["settings"]["n_prompts"] == 2 and saved["settings"]["block_size"] == 4
    acc = saved["accuracy"]
    assert acc["n"] == 2 and acc["split"] == "test" and [p["tau"] for p in acc["diffusion"]] == [0.9, 1.0]
    # the timed prompts (here every accuracy user) carry their own valid rate, equal to the whole's here
    assert acc["timed_prompts"] == 2 and acc["ar"]["timed_valid_rate"] == acc["ar"]["valid_rate"]
    assert [p["timed_valid_rate"] for p in acc["diffusion"]] == [p["valid_rate"] for p in acc["diffusion"]]
    assert "ci_low" in acc["diffusion"][0]["vs_ar"]["recall@1"]
    for row in saved["batches"]:
        assert 0.0 <= row["ar"]["recall@1"] <= 1.0 and 0.0 <= row["ar"]["valid_rate"] <= 1.0
        assert all(0.0 <= p["valid_rate"] <= 1.0 for p in row["points"])
        # the exact decoders' rows, by default: HF generate and prompt lookup, both AR's tokens
        assert [p["decoder"] for p in [row["ar"]] + row["exact_decoders"] + row["points"]] == [
            "ar", "hf_generate", "ar_lookup", "diffusion", "diffusion"]
        for p in row["exact_decoders"]:
            assert p["matches_ar"] and p["same_tokens_as_ar"] == 1.0 and p["speedup"] > 0
        hf, lookup = row["exact_decoders"]
        assert "recall@1" not in hf and lookup["recall@1"] == row["ar"]["recall@1"]
        assert lookup["valid_rate"] == row["ar"]["valid_rate"]
    assert acc["ar_lookup"]["same_target_rank_as_ar"] == 1.0
    assert saved["settings"]["exact_decoders"] == ["hf_generate", "ar_lookup"]

    # and the report builder renders it (speed table, frontier and length plots)
    from integration.bench import build_benchmarks

    md = build_benchmarks(out.parent, tmp_path / "BENCHMARKS.md", tmp_path / "plots").read_text()
    assert saved["command"] in md and "abc1234" in md
    assert "| 1 | hf_generate |" in md and "| 2 | ar_lookup |" in md and "NOT AR's tokens" not in md
    assert "Valid rate on the 2 timed prompts (on all 2 accuracy users)" in md
    assert (tmp_path / "plots" / "tau-frontier-tiny.png").stat().st_size > 0
    assert (tmp_path / "plots" / "speedup-length-tiny.png").stat().st_size > 0


def _fc(rows):
    """A forward_cost report from {batch: (one_token_ms, {B: (block_ms, fused_ms)})}."""
    return {"context": 10, "rows": [{"batch_size": b, "one_token_ms": {"median": one},
                                     "blocks": [{"block_size": B, "ms": {"median": m}, "fused_ms": {"median": f}}
                                                for B, (m, f) in blocks.items()]}
                                    for b, (one, blocks) in rows.items()]}


def test_speedup_ceiling_arithmetic():
    # L = 8, B = 4: two blocks, the first a plain step (2 ms), the second fused (3 ms) -> 8 tokens in 5 ms
    # against AR's 8 tokens in 8 ms at batch 1; at batch 8 the block steps cost more than 8 one-token steps
    fc = _fc({1: (1.0, {4: (2.0, 3.0)}), 8: (2.0, {4: (8.0, 16.0)})})
    c = speedup_ceiling(fc, length=8, steps_per_block=(1,))
    assert [(r["batch_size"], r["blocks"][0]["ceiling"]) for r in c["rows"]] == [(1, pytest.approx(1.6)),
                                                                                 (8, pytest.approx(64 / 24 / 4))]
    # a micro-batcher allowed 8 requests: the best diffusion batch (8: 64/24 tok/ms) vs the best AR batch (8: 4)
    by_c = {x["max_batch"]: x for x in c["concurrency"]}
    assert by_c[1]["ceiling"] == pytest.approx(1.6)
    assert by_c[8]["ceiling"] == pytest.approx((64 / 24) / 4) and by_c[8]["ar_batch"] == 8
    # two steps per block: 2 plain steps for block 0, fused + plain for block 1 -> 8 tokens in 9 ms
    two = speedup_ceiling(fc, length=8, steps_per_block=(2,))
    assert two["rows"][0]["blocks"][0] == {"block_size": 4, "steps_per_block": 2, "ceiling": pytest.approx(8 / 9)}
    with pytest.raises(ValueError, match="fused"):
        speedup_ceiling({"rows": [{"batch_size": 1, "one_token_ms": {"median": 1.0},
                                   "blocks": [{"block_size": 4, "ms": {"median": 2.0}}]}]}, length=8)


def test_forward_cost_fused_and_report(parts, tmp_path):
    fc = forward_cost(parts["dmodel"], 6, batch_sizes=(1, 2), block_sizes=(2, 4), iters=2, warmup=1, fused=True)
    for row in fc["rows"]:
        assert [b["block_size"] for b in row["blocks"]] == [2, 4]
        assert all(b["fused_ms"]["n"] == 2 and b["fused_ratio"] > 0 for b in row["blocks"])
    assert "fused_ms" not in forward_cost(parts["dmodel"], 6, (1,), (2,), iters=1, warmup=0)["rows"][0]["blocks"][0]
    out = tmp_path / "forward-cost-x.json"
    rep = run_forward_cost(parts["dmodel"], 6, (1, 2), (2, 4), length=10, iters=2, threads=1, out_json=out,
                           command="dgr2 forward-cost --test")
    assert json.loads(out.read_text())["command"] == "dgr2 forward-cost --test"
    assert rep["machine"]["torch_threads"] == 1 and rep["settings"]["length"] == 10
    assert [(c["max_batch"], c["steps_per_block"]) for c in rep["ceiling"]["concurrency"]] == [(1, 1), (2, 1),
                                                                                              (1, 2), (2, 2)]
    assert "concurrency 2, s=2: ceiling" in format_forward_cost(rep)


def test_measure_speed_passes_the_commit_rule(parts):
    kw = dict(batch_sizes=(2,), taus=(0.3,), max_new_tokens=8, repeats=1, warmup=0, threads=1, lengths=(),
              forward_blocks=())
    conf = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], **kw)
    pre = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], commit_rule="prefix", **kw)
    assert conf["settings"]["commit_rule"] == "confidence" and pre["settings"]["commit_rule"] == "prefix"
    # left to right commits at most as many tokens per step as the free rule on the same model
    assert pre["batches"][0]["points"][0]["tokens_per_step"] <= conf["batches"][0]["points"][0]["tokens_per_step"]


def test_independent_schedule_is_timed_with_the_same_tokens(parts, monkeypatch):
    import reranker.eval.speed as speed

    calls = []
    real = speed.diffusion_decode_independent
    monkeypatch.setattr(speed, "diffusion_decode_independent", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(batch_sizes=(2,), taus=(0.3,), max_new_tokens=8, repeats=1, warmup=0, threads=1, lengths=(),
              forward_blocks=())
    lock = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], **kw)
    assert not calls
    ind = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], schedule="independent", **kw)
    assert calls and ind["settings"]["schedule"] == "independent" and lock["settings"]["schedule"] == "lockstep"
    a, b = lock["batches"][0]["points"][0], ind["batches"][0]["points"][0]
    assert a["generated_tokens"] == b["generated_tokens"] and a["tokens_per_step"] == b["tokens_per_step"]
    # every row runs B columns a step and B more per block written; lockstep rows also while they wait
    assert b["columns_per_token"] > 0 and a["columns_per_token"] >= b["columns_per_token"]
    with pytest.raises(ValueError, match="schedule: must be one of"):
        measure_speed(parts["model"], parts["dmodel"], parts["prompts"], schedule="ragged", **kw)


def test_a_low_precision_diffusion_is_timed_beside_ar_in_both_precisions(parts):
    """compute_dtype bfloat16: diffusion runs in it, AR in float32 (the reference) and in bfloat16 too,
    so the faster AR is shown; float32 adds no row. Forward costs keep the one-token step in float32."""
    kw = dict(batch_sizes=(2,), taus=(0.3,), max_new_tokens=8, repeats=1, warmup=0, threads=1, lengths=(),
              forward_blocks=(4,), forward_iters=1)
    low = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], compute_dtype="bfloat16", **kw)
    row = low["batches"][0]
    assert low["settings"]["compute_dtype"] == "bfloat16" and low["forward_cost"]["compute_dtype"] == "bfloat16"
    ar_low, p = row["ar_compute_dtype"], row["points"][0]
    assert ar_low["compute_dtype"] == "bfloat16" and ar_low["decoder"] == "ar" and ar_low["speedup"] > 0
    assert p["compute_dtype"] == "bfloat16" and p["speedup_vs_ar_compute_dtype"]["n"] == 1
    assert "vs AR bfloat16" in format_speed(low)
    from integration.bench import speed_section

    md = "\n".join(speed_section("x", low))
    assert "| 2 | AR, bfloat16 matmuls |" in md and "τ=0.30, bfloat16 matmuls" in md
    assert "Diffusion against AR with bfloat16 matmuls too" in md
    full = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], **kw)
    assert full["batches"][0]["ar_compute_dtype"] is None and "speedup_vs_ar_compute_dtype" not in full["batches"][0][
        "points"][0]
    assert parts["model"].dtype == torch.float32 and parts["dmodel"].dtype == torch.float32
    with pytest.raises(ValueError, match="compute_dtype: must be one of"):
        measure_speed(parts["model"], parts["dmodel"], parts["prompts"], compute_dtype="half", **kw)


def test_measure_speed_passes_hold_eos_to_the_decoder(parts, monkeypatch):
    import reranker.eval.speed as speed

    seen = []
    real = speed.diffusion_decode

    def recording(*a, **k):
        seen.append(k.get("hold_eos"))
        return real(*a, **k)

    monkeypatch.setattr(speed, "diffusion_decode", recording)
    kw = dict(batch_sizes=(2,), taus=(0.3,), max_new_tokens=8, repeats=1, warmup=0, threads=1, lengths=(),
              forward_blocks=())
    rep = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], hold_eos=True, **kw)
    assert rep["settings"]["hold_eos"] is True and seen and all(seen)
    seen.clear()
    assert measure_speed(parts["model"], parts["dmodel"], parts["prompts"], **kw)["settings"]["hold_eos"] is False
    assert seen and not any(seen)


def test_exact_decoders_write_ars_tokens_side_by_side(parts):
    """hf_generate and ar_lookup rows: interleaved with AR, speed-up against it, AR's greedy tokens
    (with EOS and without it, where every row runs to the budget), tokens per forward."""
    prompts = [p + p + p for p in parts["prompts"][:2]]  # repeated spans: something for lookup to draft
    rep = measure_speed(parts["model"], parts["dmodel"], prompts, batch_sizes=(2,), taus=(0.9,), max_new_tokens=10,
                        repeats=1, warmup=0, threads=1, lengths=(12,), length_taus=(0.9,), forward_blocks=(),
                        exact_decoders=("hf_generate", "ar_lookup"))
    json.dumps(rep)
    for row in rep["batches"] + rep["length_curve"]:
        ar = row["ar"]
        assert ar["decoder"] == "ar" and ar["tokens_per_forward"] == pytest.approx(1 / ar["forward_passes_per_token"])
        hf, lookup = row["exact_decoders"]
        assert (hf["decoder"], lookup["decoder"]) == ("hf_generate", "ar_lookup")
        for p in (hf, lookup):
            assert p["matches_ar"] and p["deterministic"] and p["generated_tokens"] == ar["generated_tokens"]
            assert p["speedup"] == pytest.approx(p["tokens_per_second"]["median"] / ar["tokens_per_second"]["median"])
            assert p["speedup_paired"]["n"] == 1
        # generate runs one forward per position of its longest row and does not time its prefill
        assert hf["forward_passes"] == ar["forward_passes"]  # AR too: prefill, then one per step of its longest row
        assert hf["decode_speedup"] is None and hf["prefill_seconds"]["n"] == 0
        assert lookup["decode_speedup"] > 0 and 0 <= lookup["accepted_tokens"] <= lookup["drafted_tokens"]
        assert lookup["tokens_per_forward"] >= 1.0 and lookup["forward_passes"] <= ar["forward_passes"]
    text = format_speed(rep)
    assert "hf_generate" in text and "ar_lookup" in text and "NOT AR's tokens" not in text
    none = measure_speed(parts["model"], parts["dmodel"], prompts, batch_sizes=(1,), taus=(0.9,), max_new_tokens=4,
                         repeats=1, warmup=0, lengths=(), forward_blocks=())  # by default: none
    assert none["batches"][0]["exact_decoders"] == [] and none["settings"]["exact_decoders"] == []
    with pytest.raises(ValueError, match="exact_decoders"):
        measure_speed(parts["model"], parts["dmodel"], prompts, exact_decoders=("beam",))


def test_hf_generate_is_read_back_through_eos(parts):
    from reranker.diffusion.ar_decoder import ar_decode
    from reranker.eval.speed import hf_generate

    prompts = parts["prompts"]
    free = ar_decode(parts["model"], prompts, 12, NO_EOS).tokens
    eos = free[0][3]  # a token the first row writes: that row stops there, padded by generate after it
    ref = ar_decode(parts["model"], prompts, 12, eos, parts["model"].config.pad_token_id).tokens
    got = hf_generate(parts["model"], prompts, 12, eos, parts["model"].config.pad_token_id)
    assert got.tokens == ref and len(got.tokens[0]) <= 4
    assert got.n_forward == max(len(t) for t in ref)
    assert hf_generate(parts["model"], prompts, 12, NO_EOS, 0).tokens == free


def test_lookup_drafts_are_timed_beside_the_plain_decoder(parts):
    """With lookup_drafts each tau gets two points, without and with the drafts, timed in the same
    interleaved repeats (the ratio between them is then side by side too)."""
    rep = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], batch_sizes=(1,), taus=(0.9, 0.5),
                        max_new_tokens=8, repeats=1, warmup=0, lengths=(), forward_blocks=(), commit_rule="prefix",
                        lookup_drafts=True)
    points = rep["batches"][0]["points"]
    assert [(p["tau"], p["lookup_drafts"]) for p in points] == [(0.9, False), (0.9, True), (0.5, False), (0.5, True)]
    assert all(p["decoder"] == "diffusion" and p["speedup"] > 0 for p in points)
    assert rep["settings"]["lookup_drafts"] is True
    plain = measure_speed(parts["model"], parts["dmodel"], parts["prompts"], batch_sizes=(1,), taus=(0.9,),
                          max_new_tokens=8, repeats=1, warmup=0, lengths=(), forward_blocks=())
    assert [p["lookup_drafts"] for p in plain["batches"][0]["points"]] == [False]


def test_accuracy_reports_the_valid_rate_of_the_timed_prompts_apart(monkeypatch):
    """timed=k: each entry's timed_valid_rate is its valid rate on the first k examples alone."""
    import reranker.eval.evaluate as ev
    from reranker.eval.speed import accuracy_points

    valid = {"ar": [True, True, False, True], "diffusion": [False, True, True, True]}

    def fake(engine, examples, opts, batch_size, progress=False, keep_outputs=False):
        flags = valid[opts.decoder]
        rep = {"ranks": [1, 2, 1, 3], "valid_rate": float(np.mean(flags)), "vs_retriever": {}}
        if keep_outputs:
            rep["outputs"] = [{"valid": f} for f in flags]
        return rep

    monkeypatch.setattr(ev, "evaluate", fake)
    acc = accuracy_points(None, None, [{}] * 4, (0.9,), timed=2)
    assert acc["timed_prompts"] == 2 and acc["ar"]["timed_valid_rate"] == 1.0 and acc["ar"]["valid_rate"] == 0.75
    assert acc["diffusion"][0]["timed_valid_rate"] == 0.5
    untimed = accuracy_points(None, None, [{}] * 4, (0.9,))
    assert untimed["timed_prompts"] == 0 and "timed_valid_rate" not in untimed["ar"]
