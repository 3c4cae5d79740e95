"""SFT stage: it learns, the prompt is unsupervised, λ_r/λ_o weight what they should, and the
output is a plain HF model directory. `make_sft_world` is shared with test_ddp/test_resume/test_stages."""
import json
import random

import pytest
import torch

from reranker.model import build_model, save_model
from reranker.text.sid import format_sid
from reranker.text.tokenizer import build_tokenizer
from reranker.training.batches import IGNORE, collate, encode_examples, weighted_nll

torch.set_num_threads(1)

WORDS = ["brand", "match", "cobought", "category", "yes", "no", "recent", "strong", "weak", "first"]


def _record(rng):
    cands = [format_sid([rng.randrange(8) for _ in range(4)]) for _ in range(3)]
    hist = format_sid([rng.randrange(8) for _ in range(4)])
    user = f"History: {hist} lipstick.\n" + "\n".join(f"{i + 1}.{c} {rng.choice(WORDS)}" for i, c in enumerate(cands))
    ranking = sorted(cands, key=lambda c: c[-12:])  # a learnable rule
    reasoning = " ".join(rng.choices(WORDS, k=6))
    return {
        "prompt_messages": [{"role": "system", "content": "Re-rank the candidates."},
                            {"role": "user", "content": user}],
        "assistant": f"<think>\n{reasoning}\n</think>\n" + json.dumps({"ranking": ranking}),
    }


def make_sft_world(root, n_train=8, n_valid=4, seed=0):
    """A tiny tokenizer + Qwen3 model (hidden 32, 2 layers) saved as an HF dir, and examples JSONL."""
    rng = random.Random(seed)
    train = [_record(rng) for _ in range(n_train)]
    valid = [_record(rng) for _ in range(n_valid)]
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("valid", valid)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = [m["content"] for r in train for m in r["prompt_messages"]] + [r["assistant"] for r in train]
    tok = build_tokenizer(corpus, vocab_size=300)
    model = build_model(len(tok), "tiny", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=seed)
    save_model(model, tok, root / "init")
    return root / "init", data


# Small, fast, deterministic: no dropout in the tiny Qwen3 config (attention_dropout = 0).
FAST = {"epochs": 2, "batch_size": 4, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 1, "save_every": 2,
        "eval_batch_size": 4, "max_len": 256}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_sft_world(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="module")
def tok(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(world[0]))


def test_encoding_and_labels(world, tok):
    from reranker.training.batches import read_jsonl

    recs = read_jsonl(world[1] / "train.jsonl")
    enc, stats = encode_examples(tok, recs[:3], max_len=256)
    assert stats["prompt_truncated_examples"] == 0
    e = enc[0]
    ids = e.input_ids
    # prompt = chat template with generation header, response ends with <|im_end|>
    assert tok.decode(ids[:e.n_prompt]).endswith("<|im_start|>assistant\n")
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.convert_ids_to_tokens(ids[e.n_prompt]) == "<think>"
    assert tok.convert_ids_to_tokens(ids[e.n_prompt + e.n_reasoning]) == "</think>"
    b = collate(enc, tok.pad_token_id, lambda_r=0.5, lambda_o=1.0)
    n = len(ids)
    assert (b["labels"][0, :e.n_prompt] == IGNORE).all()
    assert (b["labels"][0, e.n_prompt:n] == torch.tensor(ids[e.n_prompt:])).all()
    assert (b["labels"][0, n:] == IGNORE).all() and (b["attention_mask"][0, n:] == 0).all()
    w = b["loss_weights"][0]
    assert (w[:e.n_prompt] == 0).all() and (w[n:] == 0).all()
    assert (w[e.n_prompt:e.n_prompt + e.n_reasoning] == 0.5).all()
    assert (w[e.n_prompt + e.n_reasoning:n] == 1.0).all()


def test_left_truncation_is_counted(world, tok):
    from reranker.training.batches import read_jsonl

    rec = read_jsonl(world[1] / "train.jsonl")[0]
    full, _ = encode_examples(tok, [rec], max_len=256)
    cut, stats = encode_examples(tok, [rec], max_len=len(full[0].input_ids) - 5)
    assert stats["prompt_truncated_examples"] == 1 and cut[0].prompt_truncated == 5
    assert cut[0].input_ids == full[0].input_ids[5:]  # the prompt lost its first 5 tokens, response intact
    assert cut[0].n_supervised == full[0].n_supervised


def test_prompt_gets_no_gradient_and_lambdas_weight_token_kinds(world, tok):
    from reranker.training.batches import read_jsonl

    enc, _ = encode_examples(tok, read_jsonl(world[1] / "train.jsonl")[:2], max_len=256)
    V = len(tok)

    def grads(lr_, lo):
        b = collate(enc, tok.pad_token_id, lr_, lo)
        logits = torch.randn(*b["input_ids"].shape, V, generator=torch.Generator().manual_seed(0), requires_grad=True)
        loss, _ = weighted_nll(logits, b["labels"], b["loss_weights"], b["answer_mask"])
        loss.backward()
        return b, logits.grad.abs().sum(-1)  # [B, T]: gradient mass per position

    b, g = grads(0.5, 1.0)
    for i, e in enumerate(enc):
        # position t predicts token t+1: positions before the last prompt token carry no loss
        assert (g[i, :e.n_prompt - 1] == 0).all()
        assert (g[i, len(e.input_ids) - 1:] == 0).all()  # last token and padding predict nothing
        assert (g[i, e.n_prompt - 1:len(e.input_ids) - 1] > 0).all()
    # λ_r = 0: reasoning targets contribute nothing; answer targets still do
    b, g0 = grads(0.0, 1.0)
    for i, e in enumerate(enc):
        p, r = e.n_prompt, e.n_reasoning
        assert (g0[i, p - 1:p - 1 + r] == 0).all()
        assert (g0[i, p - 1 + r:len(e.input_ids) - 1] > 0).all()
    # and the λ_r = 0 loss value does not move when reasoning logits change
    b = collate(enc, tok.pad_token_id, 0.0, 1.0)
    logits = torch.randn(*b["input_ids"].shape, V, generator=torch.Generator().manual_seed(1))
    base, _ = weighted_nll(logits, b["labels"], b["loss_weights"])
    e = enc[0]
    logits[0, e.n_prompt - 1:e.n_prompt - 1 + e.n_reasoning] += 5 * torch.randn(e.n_reasoning, V)
    again, _ = weighted_nll(logits, b["labels"], b["loss_weights"])
    assert torch.allclose(base, again)


def test_lambda_order_is_enforced():
    from reranker.stages.sft import DEFAULTS, check_config

    with pytest.raises(ValueError, match="lambda_r"):
        check_config({**DEFAULTS, "lambda_r": 2.0, "lambda_o": 1.0})
    check_config({**DEFAULTS, "lambda_r": 2.0, "lambda_o": 1.0, "allow_lambda_r_above_lambda_o": True})


def test_sft_learns_and_writes_a_loadable_model(world, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reranker.stages.pipeline import run_stage
    from reranker.training.logging import read_metrics

    init, data = world
    out = tmp_path / "sft"
    s = run_stage("sft", init, out, data, {**FAST, "epochs": 12, "batch_size": 8, "lr": 1e-2}, run_dir=tmp_path / "run",
                  progress=False, device="cpu")
    assert s["status"] == "done" and s["optimizer_steps"] == 12
    losses = [r["loss"] for r in read_metrics(tmp_path / "run", "train")]
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0], losses
    val = [r["loss"] for r in read_metrics(tmp_path / "run", "valid")]
    assert len(val) == 12 and min(val) < val[0]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    done = json.loads((out / "stage_done.json").read_text())
    assert done["optimizer_steps"] == 12 and done["metrics"]["best_val_loss"] == pytest.approx(min(val))
    assert not (tmp_path / "sft.partial").exists()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert model.config.hidden_size == 32 and len(tok) == model.config.vocab_size
    # the output is the best-validation model, not the last one
    best_step = done["metrics"]["best_step"]
    assert best_step == [r["step"] for r in read_metrics(tmp_path / "run", "valid")][val.index(min(val))]


def test_warmup_cosine_schedule():
    from reranker.training.schedule import WarmupCosine

    f = WarmupCosine(warmup_steps=4, total_steps=20, min_ratio=0.1)
    ramp = [f(s) for s in range(5)]
    assert ramp == sorted(ramp) and 0 < ramp[0] < ramp[3] < 1 and ramp[4] == pytest.approx(1.0)
    decay = [f(s) for s in range(4, 21)]
    assert decay == sorted(decay, reverse=True) and decay[-1] == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_train_file_list_is_a_mix(world, tmp_path):
    """A list of train files pools their records (a file listed twice counts twice); the stage
    runs on it and its data log counts the pooled examples."""
    from reranker.stages.pipeline import run_stage
    from reranker.training.batches import read_train_records
    from reranker.training.logging import read_metrics

    init, data = world
    extra = tmp_path / "extra.jsonl"
    extra.write_text((data / "valid.jsonl").read_text())
    one = read_train_records(data, "train.jsonl")
    mix = read_train_records(data, ["train.jsonl", str(extra), str(extra)])
    assert len(one) == 8 and len(mix) == 8 + 2 * 4 and mix[:8] == one and mix[8:12] == mix[12:]
    assert len(read_train_records(data, ["train.jsonl", str(extra)], limit=10)) == 10
    with pytest.raises(ValueError, match="non-empty list"):
        read_train_records(data, [])
    with pytest.raises(ValueError, match="expected file paths"):
        read_train_records(data, ["train.jsonl", 3])
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*read from the data directory"):
        read_train_records(data, ["train.jsonl", "nope.jsonl"])
    s = run_stage("sft", init, tmp_path / "sft", data, {**FAST, "epochs": 1, "train_file": ["train.jsonl", str(extra)]},
                  run_dir=tmp_path / "run", progress=False, device="cpu")
    assert s["status"] == "done" and s["optimizer_steps"] == 12 // 4
    assert [r["examples"] for r in read_metrics(tmp_path / "run", "data")] == [12]


def test_unmasked_forward_equals_the_padding_masked_one(world):
    """collate pads on the right, so dropping the padding mask changes no real token's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reranker.stages.sft import _forward
    from reranker.training.batches import collate, encode_examples, read_jsonl

    init, data = world
    tok = AutoTokenizer.from_pretrained(str(init))
    model = AutoModelForCausalLM.from_pretrained(str(init)).eval()
    enc, _ = encode_examples(tok, read_jsonl(data / "train.jsonl"), 256)
    b = collate(enc[:4], tok.pad_token_id)
    assert (b["attention_mask"] == 0).any()  # the batch does have padding
    with torch.no_grad():
        masked = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"], use_cache=False).logits
        plain, start = _forward(model, b)
    assert 0 < start < b["input_ids"].shape[1] - 1  # the prompt's columns were left out
    real = b["attention_mask"].bool()[:, start:]
    torch.testing.assert_close(plain[real], masked[:, start:][real], atol=1e-5, rtol=1e-5)


def test_loss_on_kept_columns_equals_the_full_logits_loss(world):
    """Projecting only the columns from the first one that predicts a supervised token gives the
    same weighted loss, statistics and gradients as the full logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reranker.stages.sft import _forward, _nll
    from reranker.training.batches import read_jsonl

    init, data = world
    tok = AutoTokenizer.from_pretrained(str(init))
    enc, _ = encode_examples(tok, read_jsonl(data / "train.jsonl"), 256)
    b = collate(enc[:5], tok.pad_token_id, 0.5, 1.0)
    grads = []
    for kept in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(init))
        if kept:
            loss, st = _nll(*_forward(model, b), b)
        else:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits
            loss, st = weighted_nll(logits, b["labels"], b["loss_weights"], b["answer_mask"])
        loss.backward()
        grads.append((float(loss.detach()), st, [p.grad.clone() for p in model.parameters()]))
    (l1, s1, g1), (l2, s2, g2) = grads
    assert l1 == pytest.approx(l2, rel=1e-5) and s1["tokens"] == s2["tokens"]
    assert s1["answer_tokens"] == s2["answer_tokens"] and s1["nll_sum"] == pytest.approx(s2["nll_sum"], rel=1e-5)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-4)
