"""The engine: request -> prompt -> AR / diffusion decode -> always a valid permutation."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

from reranker.data.evidence import CoPurchaseCounts, item_meta_lookup
from reranker.diffusion.convert import convert_to_diffusion
from reranker.engine import DecodeOptions, RerankEngine, RerankRequest
from reranker.eval.evaluate import evaluate
from reranker.model import build_model, save_model
from reranker.text.prompt import render_assistant
from reranker.text.sid import build_semantic_ids
from reranker.text.tokenizer import build_tokenizer

ITEMS = [f"it{k}" for k in range(40)]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"item_id": ITEMS, "title": [f"Thing {k}" for k in range(40)],
                          "brand": [f"Brand{k % 5}" for k in range(40)],
                          "categories": [["Beauty", f"Leaf{k % 7}"] for k in range(40)]})
    sids = build_semantic_ids(rng.normal(size=(40, 8)).astype(np.float32), ITEMS, codebook_size=4)
    meta = item_meta_lookup(frame)
    seqs = {f"u{u}": [ITEMS[(u + 3 * k) % 40] for k in range(6)] for u in range(30)}
    cp = CoPurchaseCounts.fit({u: s[:-2] for u, s in seqs.items()})
    corpus = [render_assistant("brand match and cobought evidence", [sids.sid_string(i) for i in ITEMS[:10]])] * 5
    tok = build_tokenizer(corpus + [f"History Candidates retriever order cobought brand category {t}" for t in ITEMS],
                          vocab_size=400)
    model = build_model(len(tok), size="tiny", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    d = tmp_path_factory.mktemp("engine")
    save_model(model, tok, d / "ar")
    dmodel, dtok = convert_to_diffusion(d / "ar", d / "diff", block_size=4)
    return dict(sids=sids, meta=meta, cp=cp, tok=tok, model=model, dmodel=dmodel, dtok=dtok)


def request(k=0):
    return RerankRequest(history=ITEMS[k:k + 4], candidates=ITEMS[10 + k:20 + k], scores=[1.0] * 10, user="u1")


@pytest.mark.parametrize("decoder", ["ar", "ar_lookup", "diffusion"])
def test_random_model_falls_back_to_retriever_order(parts, decoder):
    model, tok = (parts["model"], parts["tok"]) if decoder == "ar" else (parts["dmodel"], parts["dtok"])
    eng = RerankEngine(model, tok, parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    out = eng.rerank([request(0), request(1)], DecodeOptions(decoder=decoder, max_new_tokens=12))
    for r in out:
        assert sorted(r.permutation) == list(range(10))
        assert r.fallback == (not r.valid)
        if r.fallback:
            assert r.permutation == list(range(10)) and r.failure
        assert 0 < r.generated_tokens <= 12 and r.forward_passes >= 1


def test_ar_lookup_decoder_writes_the_ar_decoders_answer(parts):
    """`--decoder ar_lookup` reaches the engine and evaluation, and answers exactly as greedy AR does."""
    from integration.cli import build_parser

    args = build_parser().parse_args(["eval", "--model", "m", "--data", "d", "--decoder", "ar_lookup"])
    assert args.decoder == "ar_lookup"
    eng = RerankEngine(parts["model"], parts["tok"], parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    reqs = [request(0), request(1), request(2)]
    ar = eng.rerank(reqs, DecodeOptions(decoder="ar", max_new_tokens=24))
    lookup = eng.rerank(reqs, DecodeOptions(decoder="ar_lookup", max_new_tokens=24))
    assert [r.text for r in lookup] == [r.text for r in ar]
    assert [r.permutation for r in lookup] == [r.permutation for r in ar]
    assert lookup[0].forward_passes <= ar[0].forward_passes
    examples = [{"history": r.history, "candidates": r.candidates, "target_index": 1} for r in reqs]
    rep = evaluate(eng, examples, DecodeOptions(decoder="ar_lookup", max_new_tokens=24), batch_size=2, progress=False)
    assert rep["decoder"] == "ar_lookup" and rep["n"] == 3


def test_greedy_diffusion_batches_move_rows_independently_with_the_lockstep_answers(parts, monkeypatch):
    """A greedy batch (one row or more) decodes with the independent schedule; its answers are the
    lockstep decoder's (what each row gets alone), and an approximation option keeps lockstep."""
    import reranker.engine as engine_module
    from reranker.diffusion.diffusion_decoder import diffusion_decode

    eng = RerankEngine(parts["dmodel"], parts["dtok"], parts["sids"], parts["meta"], parts["cp"],
                       max_prompt_tokens=4096)
    reqs = [request(0), request(1), request(2)]
    opts = DecodeOptions(decoder="diffusion", max_new_tokens=16, tau=0.3)
    prompts = [eng.prompt_ids(r) for r in reqs]
    lock = diffusion_decode(parts["dmodel"], prompts, 16, 4, int(eng.diffusion["mask_token_id"]), eng.eos_id,
                            eng.pad_id, tau=0.3, commit_rule=opts.commit_rule, hold_eos=opts.hold_eos)
    calls = []
    real = engine_module.diffusion_decode_independent
    monkeypatch.setattr(engine_module, "diffusion_decode_independent",
                        lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    tokens, _, _ = eng.decode(prompts, opts)
    assert calls == [3] and tokens == lock.tokens
    assert len(eng.rerank(reqs, opts)) == 3 and calls == [3, 3]  # what serving and eval call
    eng.rerank(reqs, DecodeOptions(decoder="diffusion", max_new_tokens=16, tau=0.3, reuse_settled=True))
    assert calls == [3, 3]  # the approximation went through the lockstep decoder
    tokens, _, _ = eng.decode(prompts[:1], opts)
    assert calls == [3, 3, 1] and tokens == lock.tokens[:1]  # a single row is packed too


@pytest.mark.parametrize("decoder", ["ar", "diffusion"])
def test_compute_dtype_sets_the_matmul_precision_of_the_decode_only(parts, decoder):
    """bfloat16 runs the decode's matmuls in bfloat16 (autocast) and leaves nothing behind: the weights
    stay float32 and a float32 decode afterwards gets float32 matmuls and its own answer again."""
    model, tok = (parts["model"], parts["tok"]) if decoder == "ar" else (parts["dmodel"], parts["dtok"])
    eng = RerankEngine(model, tok, parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    try:
        prompts = [eng.prompt_ids(request(0))]
        full, _, _ = eng.decode(prompts, DecodeOptions(decoder=decoder, max_new_tokens=8))
        assert seen and set(seen) == {torch.float32}
        seen.clear()
        low, _, _ = eng.decode(prompts, DecodeOptions(decoder=decoder, max_new_tokens=8, compute_dtype="bfloat16"))
        assert seen and set(seen) == {torch.bfloat16}
        assert len(low[0]) >= 1 and model.dtype == torch.float32
        seen.clear()
        again, _, _ = eng.decode(prompts, DecodeOptions(decoder=decoder, max_new_tokens=8))
        assert set(seen) == {torch.float32} and again == full
    finally:
        hook.remove()


def test_valid_answer_is_parsed_into_the_permutation(parts):
    eng = RerankEngine(parts["model"], parts["tok"], parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    req = request(0)
    order = [3, 0, 9, 1, 2, 4, 5, 6, 7, 8]
    text = render_assistant("because", [parts["sids"].sid_string(req.candidates[i]) for i in order]) + "<|im_end|>"
    ids = parts["tok"](text, add_special_tokens=False)["input_ids"]
    eng.decode = lambda prompts, options: ([ids for _ in prompts], 1, None)  # this instance only
    (res,) = eng.rerank([req])
    assert res.valid and not res.fallback and res.permutation == order and res.reasoning == "because"
    rep = evaluate(eng, [{"history": req.history, "candidates": req.candidates, "target_index": 3}],
                   DecodeOptions(), progress=False)
    assert rep["recall@1"] == 1.0 and rep["retriever"]["recall@1"] == 0.0 and rep["valid_rate"] == 1.0
    # one forward pass wrote both rows of a batch of two: per row that is one pass per row's tokens
    ex = {"history": req.history, "candidates": req.candidates, "target_index": 3}
    rep = evaluate(eng, [ex, ex], DecodeOptions(), batch_size=2, progress=False)
    n = res.generated_tokens
    assert rep["forward_passes_per_token"] == pytest.approx(1 / n)
    assert rep["forward_passes_per_token_batched"] == pytest.approx(1 / (2 * n))


def test_eval_keeps_each_examples_output_and_failure(parts, tmp_path):
    from reranker.eval.evaluate import write_outputs

    eng = RerankEngine(parts["model"], parts["tok"], parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    req = request(0)
    good = render_assistant("because", [parts["sids"].sid_string(req.candidates[i]) for i in [2, 0, 1, *range(3, 10)]])
    bad = render_assistant("because", [parts["sids"].sid_string(req.candidates[0])] * 10)  # a duplicate SID
    texts = iter([good + "<|im_end|>", bad + "<|im_end|>"])
    ids = [parts["tok"](t, add_special_tokens=False)["input_ids"] for t in texts]
    eng.decode = lambda prompts, options: (ids[:len(prompts)], 1, None)  # this instance only
    examples = [{"history": req.history, "candidates": req.candidates, "target_index": 2, "user": "u1"},
                {"history": req.history, "candidates": req.candidates, "target_index": 5, "user": "u2"}]
    rep = evaluate(eng, examples, DecodeOptions(), batch_size=2, progress=False, keep_outputs=True)
    first, second = rep["outputs"]
    assert (first["user"], first["valid"], first["failure"], first["permutation"][:3]) == ("u1", True, None, [2, 0, 1])
    assert (second["user"], second["valid"], second["failure"]) == ("u2", False, "duplicate")
    assert second["permutation"] == list(range(10)) and second["target_index"] == 5 and "because" in second["text"]
    out = write_outputs(tmp_path / "outputs.jsonl", rep["outputs"])
    assert [json.loads(line) for line in out.read_text().splitlines()] == rep["outputs"]
    assert not list(tmp_path.glob(".*.tmp"))  # written to a temp file, then renamed


def test_eval_workers_decode_batches_at_once_and_keep_the_order(parts):
    """`evaluate(..., workers=2)`: two batches decode at once, on two threads, and every example's
    output lands where one worker puts it; torch's threads are given back."""
    import threading
    import time as _time


    eng = RerankEngine(parts["model"], parts["tok"], parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    reqs = [request(k) for k in range(6)]
    orders = [[k % 10, *[j for j in range(10) if j != k % 10]] for k in range(6)]
    by_prompt = {tuple(eng.prompt_ids(r)): parts["tok"](render_assistant(
        "because", [parts["sids"].sid_string(r.candidates[i]) for i in order]) + "<|im_end|>",
        add_special_tokens=False)["input_ids"] for r, order in zip(reqs, orders)}
    threads, running, peak = set(), [0], [0]
    lock = threading.Lock()

    def fake_decode(prompts, options):  # this instance only
        with lock:
            threads.add(threading.current_thread().name)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        _time.sleep(0.2)
        with lock:
            running[0] -= 1
        return [by_prompt[tuple(p)] for p in prompts], 1, None

    eng.decode = fake_decode
    examples = [{"history": r.history, "candidates": r.candidates, "target_index": k % 10, "user": f"u{k}"}
                for k, r in enumerate(reqs)]
    before = torch.get_num_threads()
    one = evaluate(eng, examples, DecodeOptions(), batch_size=2, progress=False, keep_outputs=True)
    assert peak[0] == 1
    two = evaluate(eng, examples, DecodeOptions(), batch_size=2, progress=False, keep_outputs=True, workers=2)
    assert peak[0] == 2 and len(threads) >= 2 and torch.get_num_threads() == before
    assert [o["permutation"] for o in two["outputs"]] == [o["permutation"] for o in one["outputs"]] == orders
    assert two["recall@1"] == one["recall@1"] == 1.0 and two["workers"] == 2
    with pytest.raises(ValueError, match="workers"):
        evaluate(eng, examples, DecodeOptions(), workers=0, progress=False)


def test_bad_requests_are_clear(parts):
    eng = RerankEngine(parts["model"], parts["tok"], parts["sids"], parts["meta"], parts["cp"], max_prompt_tokens=4096)
    with pytest.raises(ValueError, match="'nope' has no semantic ID"):
        eng.rerank([RerankRequest(history=[], candidates=["nope"])])
    with pytest.raises(ValueError, match=r"tau: must be in \(0, 1\], got 1.5"):
        eng.rerank([request()], DecodeOptions(tau=1.5))
    with pytest.raises(ValueError, match="needs a converted model"):
        eng.rerank([request()], DecodeOptions(decoder="diffusion"))
