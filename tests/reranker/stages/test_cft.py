"""CFT stage: EOS fill and token weights, a fixed validation noise draw, and on a tiny overfit set
the loss falls and τ = 0.9 greedy decoding reproduces a training response better than the naive
conversion did; the output keeps config.diffusion. `make_cft_world` is shared with test_opd."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from test_sft import make_sft_world
from reranker.diffusion import diffusion_decode
from reranker.diffusion.convert import convert_to_diffusion, load_diffusion_config
from reranker.stages.cft import DEFAULTS, cft_batch, evaluate_loss
from reranker.stages.pipeline import run_stage
from reranker.training.batches import token_ids
from reranker.training.candidates import load_split
from reranker.training.logging import read_metrics

torch.set_num_threads(1)
B = 8


def make_cft_world(root, n_train=4, n_valid=2, repeat=1, valid_is_train=False):
    """make_sft_world plus each row's "candidate_sids" (so the valid-JSON check runs); the train
    rows are repeated `repeat` times (more steps per epoch on the same tiny overfit set)."""
    init, data = make_sft_world(root, n_train=n_train, n_valid=n_valid)
    rows = {}
    for name in ("train", "valid"):
        rows[name] = [json.loads(line) for line in (data / f"{name}.jsonl").read_text().splitlines()]
        for r in rows[name]:
            r["candidate_sids"] = json.loads(r["assistant"].split("</think>\n")[1])["ranking"]
    if valid_is_train:
        rows["valid"] = rows["train"]
    for name, rs in rows.items():
        text = "".join(json.dumps(r) + "\n" for r in rs)
        (data / f"{name}.jsonl").write_text(text * (repeat if name == "train" else 1))
    return init, data


def token_accuracy(model, tok, examples, block_size, tau=0.9):
    eos, pad = token_ids(tok)
    refs = [e.input_ids[e.n_prompt:] for e in examples]
    res = diffusion_decode(model.eval(), [e.input_ids[:e.n_prompt] for e in examples], max(map(len, refs)) + block_size,
                           block_size, tok.mask_token_id, eos, pad_token_id=pad, tau=tau)
    return sum(sum(a == b for a, b in zip(o, r)) for o, r in zip(res.tokens, refs)) / sum(map(len, refs))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cft")
    init, data = make_cft_world(root, repeat=10, valid_is_train=True)
    conv = root / "converted"
    convert_to_diffusion(init, conv, block_size=B)
    return init, conv, data


def test_eos_fill_and_token_weights(world):
    _, conv, data = world
    tok = AutoTokenizer.from_pretrained(str(conv))
    enc, _, _ = load_split(tok, data, "valid.jsonl", None, 256)
    eos, pad = token_ids(tok)
    assert eos == tok.convert_tokens_to_ids("<|im_end|>")
    x, plen, rlen, w = cft_batch(enc, pad, eos, B, 0.5, 1.0, 0.25, "cpu")
    P = int(plen.max())
    assert (rlen % B == 0).all() and w.shape == (len(enc), int(rlen.max()))
    for i, e in enumerate(enc):
        n = e.n_supervised
        assert int(rlen[i]) == -(-n // B) * B and int(rlen[i]) - n < B
        y = x[i, P:P + int(rlen[i])]
        assert y[:n].tolist() == e.input_ids[e.n_prompt:] and y[n - 1] == eos  # the response ends with EOS...
        assert (y[n:] == eos).all()  # ...and the rest of its last block is EOS fill
        assert (w[i, :e.n_reasoning] == 0.5).all() and (w[i, e.n_reasoning:n] == 1.0).all()
        assert (w[i, n:int(rlen[i])] == 0.25).all() and (w[i, int(rlen[i]):] == 0).all()
    assert any(int(r) > e.n_supervised for r, e in zip(rlen, enc))  # some fill was needed
    # fill_weight None means λ_o
    from reranker.stages.cft import _weights
    assert _weights({**DEFAULTS, "lambda_o": 0.8})[2] == 0.8


def test_train_file_list_pools_files_like_sft(world):
    """cft (and opd) take a list of training files, as sft does: a mix of real lists and copy data."""
    _, conv, data = world
    tok = AutoTokenizer.from_pretrained(str(conv))
    one, cands, _ = load_split(tok, data, "valid.jsonl", None, 256)
    mix, mix_cands, _ = load_split(tok, data, ["valid.jsonl", "valid.jsonl"], None, 256)
    assert [e.input_ids for e in mix] == [e.input_ids for e in one] * 2 and mix_cands == cands * 2
    with pytest.raises(ValueError, match="non-empty list"):
        load_split(tok, data, [], None, 256)


def test_validation_noise_is_fixed(world):
    _, conv, data = world
    tok = AutoTokenizer.from_pretrained(str(conv))
    model = AutoModelForCausalLM.from_pretrained(str(conv))
    enc, _, _ = load_split(tok, data, "valid.jsonl", None, 256)
    a = evaluate_loss(model, enc, DEFAULTS, token_ids(tok), B, tok.mask_token_id, "cpu")
    b = evaluate_loss(model, enc, DEFAULTS, token_ids(tok), B, tok.mask_token_id, "cpu")
    c = evaluate_loss(model, enc, {**DEFAULTS, "valid_noise_seed": 7}, token_ids(tok), B, tok.mask_token_id, "cpu")
    assert a == b and a != c
    # suffix-aligned masks are a different (and, for an unconverged model, different-loss) draw
    d = evaluate_loss(model, enc, {**DEFAULTS, "suffix_fraction": 1.0}, token_ids(tok), B, tok.mask_token_id, "cpu")
    assert d != a


def test_suffix_fraction_is_checked():
    from reranker.stages.cft import check_config
    check_config({**DEFAULTS, "suffix_fraction": 0.5})
    with pytest.raises(ValueError, match="suffix_fraction"):
        check_config({**DEFAULTS, "suffix_fraction": 1.5})


def test_cft_learns_to_decode_and_keeps_the_diffusion_config(world, tmp_path):
    _, conv, data = world
    tok = AutoTokenizer.from_pretrained(str(conv))
    enc, _, _ = load_split(tok, data, "valid.jsonl", None, 256)  # valid = the 4 training examples
    before = token_accuracy(AutoModelForCausalLM.from_pretrained(str(conv)), tok, enc, B)
    cfg = {"epochs": 10, "batch_size": 4, "lr": 1e-2, "warmup_steps": 2, "complementary": True, "lambda_r": 1.0,
           "save_every": 0, "eval_batch_size": 4, "max_len": 256, "decode_examples": 2}
    out, run = tmp_path / "cft", tmp_path / "run"
    s = run_stage("cft", conv, out, data, cfg, run_dir=run, progress=False, device="cpu")
    assert s["status"] == "done" and s["optimizer_steps"] == 100
    train = [r["loss"] for r in read_metrics(run, "train")]
    assert sum(train[-10:]) < 0.3 * sum(train[:10]), (train[:10], train[-10:])
    val = read_metrics(run, "valid")
    assert len(val) == 10 and val[-1]["loss"] < 0.3 * val[0]["loss"]
    assert all(0 <= r["valid_json_rate"] <= 1 and 0 < r["tokens_per_step"] for r in val)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert load_diffusion_config(model) == {"block_size": B, "mask_token_id": tok.mask_token_id,
                                            "mask_token": "<|mask|>", "ar_token_shift": True}
    done = json.loads((out / "stage_done.json").read_text())
    assert done["metrics"]["block_size"] == B and done["metrics"]["best_val_loss"] == pytest.approx(
        min(r["loss"] for r in val))
    after = token_accuracy(model, tok, enc, B)
    assert after > before + 0.3, (before, after)


def test_plain_ar_input_is_converted_first(world, tmp_path, capsys):
    init, _, data = world
    cfg = {"epochs": 1, "max_steps": 1, "batch_size": 4, "block_size": 4, "valid_file": None, "max_len": 256,
           "save_every": 0}
    s = run_stage("cft", init, tmp_path / "out", data, cfg, run_dir=tmp_path / "run", progress=False, device="cpu")
    assert s["optimizer_steps"] == 1
    assert "plain AR model: converted to block diffusion (block size 4)" in capsys.readouterr().err
    info = load_diffusion_config(AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")))
    assert info["block_size"] == 4
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).mask_token_id == info["mask_token_id"]


def torchrun_matches_one_process(stage, inp, data, cfg, tmp_path, tol=1e-5):
    """Run `stage` with 1 process (grad_accum 2) and under torchrun with 2 (grad_accum 1): same
    global batches, same noise, so the same metrics and weights. Returns the metric rows."""
    one = run_stage(stage, inp, tmp_path / "out1", data, {**cfg, "grad_accum": 2}, run_dir=tmp_path / "run1",
                    progress=False, device="cpu")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "reranker.stages.pipeline", "--stage", stage, "--input", str(inp), "--output", str(tmp_path / "out2"),
           "--data", str(data), "--run-dir", str(tmp_path / "run2"), "--no-progress", "--device", "cpu",
           "--config-json", json.dumps({**cfg, "grad_accum": 1})]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads((tmp_path / "out2" / "stage_done.json").read_text())
    assert done["world_size"] == 2 and done["optimizer_steps"] == one["optimizer_steps"] > 0
    rows = {}
    for kind in ("train", "valid"):
        a, b = read_metrics(tmp_path / "run1", kind), read_metrics(tmp_path / "run2", kind)
        assert a and [r["step"] for r in a] == [r["step"] for r in b]
        for ra, rb in zip(a, b):
            assert all(abs(ra[k] - rb[k]) < tol for k in ra if isinstance(ra[k], float)), (kind, ra, rb)
        rows[kind] = a
    w1, w2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("out1", "out2"))
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < tol
    return rows


def test_torchrun_two_processes_match_one_process(world, tmp_path):
    _, conv, data = world
    cfg = {"epochs": 1, "max_steps": 2, "batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "max_len": 256,
           "eval_batch_size": 2, "decode_examples": 2}
    rows = torchrun_matches_one_process("cft", conv, data, cfg, tmp_path)
    assert "valid_json_rate" in rows["valid"][0]
