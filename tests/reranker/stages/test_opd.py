"""OPD: with B = 1 and the student = the teacher the loss is 0 (acceptance); the teacher pass is
AR-shift aligned; only kept (through EOS) positions are distilled; the loss is trainable; the stage
runs end to end, needs a teacher, and resumes after a kill to the same step count and losses."""
import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from test_cft import make_cft_world, torchrun_matches_one_process
from reranker.diffusion import ar_decode
from reranker.diffusion.convert import convert_to_diffusion, load_diffusion_config
from reranker.stages.opd import kept_responses, make_rollouts, opd_loss_sum, replayed_loss, teacher_scores
from reranker.stages.pipeline import run_stage
from reranker.training.batches import token_ids
from reranker.training.candidates import load_split
from reranker.training.checkpoint import FAULT_ENV
from reranker.training.logging import read_metrics

torch.set_num_threads(1)
ROLL = {"max_new_tokens": 20, "tau": 0.9, "max_steps_per_block": None, "commit_rule": "confidence", "top_k": 64}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    teacher, data = make_cft_world(root, n_train=4, n_valid=2)
    students = {}
    for b in (1, 4):
        convert_to_diffusion(teacher, root / f"student_b{b}", block_size=b)
        students[b] = root / f"student_b{b}"
    return teacher, students, data


def load(path):
    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


def rollouts(world, b, k=64, temperature=1.0, seed=0):
    teacher_dir, students, data = world
    student, tok = load(students[b])
    teacher, _ = load(teacher_dir)
    enc, cands, _ = load_split(tok, data, "train.jsonl", None, 256)
    prompts = [e.input_ids[:e.n_prompt] for e in enc for _ in range(4)]  # G' = 4 per prompt
    r = make_rollouts(student, teacher, tok, prompts, [c for c in cands for _ in range(4)], {**ROLL, "top_k": k},
                      b, tok.mask_token_id, token_ids(tok), temperature, torch.Generator().manual_seed(seed))
    return student, teacher, tok, r


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("k", [64, 0])
def test_block_size_one_student_equal_to_teacher_has_zero_loss(world, kind, k):
    student, _, tok, r = rollouts(world, 1, k)
    assert len({tuple(t) for t in r.result.tokens}) > 1  # sampled, not all identical
    loss, n = opd_loss_sum(student, r.cache, r.prompts, r.result.trajectories, 1, tok.mask_token_id,
                           token_ids(tok)[1], kind)
    assert n == sum(t.length for t in r.result.trajectories) > 0
    assert abs(float(loss.detach()) / n) < 1e-6


def test_replaying_a_few_rollouts_at_a_time_gives_the_same_loss_and_gradient(world):
    """Training replays REPLAY_ROWS rollouts per backward (memory): the summed loss and the gradient
    must be those of one pass over every rollout."""
    student, teacher, tok, r = rollouts(world, 4, seed=2)
    # rows keeping different numbers of positions (as EOS makes them), so slices of the cache differ
    trajs = [dataclasses.replace(t, length=t.length - i % 5) for i, t in enumerate(r.result.trajectories)]
    cache, _ = teacher_scores(teacher, r.prompts, kept_responses(trajs), token_ids(tok)[1])
    r = dataclasses.replace(r, result=dataclasses.replace(r.result, trajectories=trajs), cache=cache)
    args = (4, tok.mask_token_id, token_ids(tok)[1], "forward_kl", 0.5, None)
    loss, _ = opd_loss_sum(student, r.cache, r.prompts, r.result.trajectories, *args)
    (loss / 7).backward()
    whole = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    total = replayed_loss(student, r, *args, "none", scale=1 / 7, rows=3)  # 16 rollouts: slices of 3, 3, ..., 1
    torch.testing.assert_close(total, float(loss.detach()), rtol=1e-5, atol=1e-5)
    for g, w in zip((p.grad for p in student.parameters()), whole):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert sum(len(c) for *_, c in r.row_slices(3)) == len(r.cache)


def test_teacher_pass_is_shift_aligned(world):
    """Teacher-forced log-probs of an AR sample equal the ones recorded while sampling it."""
    teacher, tok = load(world[0])
    enc, _, _ = load_split(tok, world[2], "train.jsonl", None, 256)
    prompts = [e.input_ids[:e.n_prompt] for e in enc]
    eos, pad = token_ids(tok)
    ar = ar_decode(teacher, prompts, 12, eos, pad, temperature=1.0, generator=torch.Generator().manual_seed(3))
    cache, lp = teacher_scores(teacher, prompts, ar.tokens, pad, top_k=0)
    torch.testing.assert_close(lp, torch.cat(ar.logprobs), atol=1e-5, rtol=0)
    assert len(cache) == sum(map(len, ar.tokens)) and cache.top_k == 0


def test_only_kept_positions_are_distilled(world):
    # a very short max_new_tokens forces stops mid-block for some rows; EOS ends others
    student, _, tok, r = rollouts(world, 4, seed=1)
    trajs = r.result.trajectories
    assert len(r.cache) == sum(t.length for t in trajs)
    assert all((t.committed[:t.length]).all() for t in trajs)  # every kept position was committed
    loss, n = opd_loss_sum(student, r.cache, r.prompts, trajs, 4, tok.mask_token_id, token_ids(tok)[1])
    assert n == len(r.cache) and float(loss.detach()) > 0


def test_loss_is_trainable(world):
    student, _, tok, r = rollouts(world, 4, seed=2)
    with torch.no_grad():  # a student far from its (near-uniform, random) teacher: 4x sharper logits
        student.model.norm.weight.mul_(4.0)
    opt = torch.optim.Adam(student.parameters(), lr=3e-3)
    pad = token_ids(tok)[1]
    losses = []
    for _ in range(5):
        loss, n = opd_loss_sum(student, r.cache, r.prompts, r.result.trajectories, 4, tok.mask_token_id, pad)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
        losses.append(float(loss.detach()) / n)
    assert losses[-1] < 0.5 * losses[0], losses


CFG = {"batch_size": 2, "group_size": 4, "epochs": 3, "max_new_tokens": 16, "lr": 1e-3, "warmup_steps": 1,
       "save_every": 2, "eval_examples": 2, "max_len": 256}


def test_stage_end_to_end(world, tmp_path):
    teacher, students, data = world
    out, run = tmp_path / "opd", tmp_path / "run"
    s = run_stage("opd", students[4], out, data, {**CFG, "teacher": str(teacher)}, run_dir=run, progress=False,
                  device="cpu")
    assert s["status"] == "done" and s["optimizer_steps"] == 6  # 4 prompts / 2 per step x 3 epochs
    rows = read_metrics(run, "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["kl"] >= 0 and 0 <= r["valid_json_rate"] <= 1 and r["tokens_per_step"] > 0
        assert r["tokens"] > 0 and r["teacher_nll"] > 0
    assert len(read_metrics(run, "valid")) == 3
    done = json.loads((out / "stage_done.json").read_text())
    assert done["optimizer_steps"] == 6 and done["metrics"]["divergence"] == "forward_kl"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert load_diffusion_config(model)["block_size"] == 4


def test_teacher_is_required(world, tmp_path):
    with pytest.raises(ValueError, match="teacher"):
        run_stage("opd", world[1][4], tmp_path / "o", world[2], CFG, run_dir=tmp_path / "r", progress=False,
                  device="cpu")


def test_killed_stage_resumes_to_the_same_steps(world, tmp_path):
    teacher, students, data = world
    cfg = {**CFG, "teacher": str(teacher), "eval_examples": 0}
    ref = run_stage("opd", students[4], tmp_path / "ref", data, cfg, run_dir=tmp_path / "ref_run", progress=False,
                    device="cpu")
    out, run = tmp_path / "out", tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", FAULT_ENV: "3"}
    cmd = [sys.executable, "-m", "reranker.stages.pipeline", "--stage", "opd", "--input", str(students[4]),
           "--output", str(out), "--data", str(data), "--run-dir", str(run), "--no-progress", "--device", "cpu",
           "--config-json", json.dumps(cfg)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not out.exists() and [r["step"] for r in read_metrics(run, "train")] == [1, 2, 3]
    res = run_stage("opd", students[4], out, data, cfg, run_dir=run, progress=False, device="cpu")
    assert res["optimizer_steps"] == ref["optimizer_steps"] == 6 and res["metrics"]["resumed_from_step"] == 2
    a, b = read_metrics(tmp_path / "ref_run", "train"), read_metrics(run, "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    # the same rollouts (noise keyed by step and micro-batch) and weights: the same losses
    assert all(abs(x["kl"] - y["kl"]) < 1e-5 and x["tokens"] == y["tokens"] for x, y in zip(a, b))


def test_torchrun_two_processes_match_one_process(world, tmp_path):
    """Each rank samples its own prompts; the global mean and the summed gradients equal 1 process."""
    teacher, students, data = world
    cfg = {**CFG, "teacher": str(teacher), "epochs": 1}
    rows = torchrun_matches_one_process("opd", students[4], data, cfg, tmp_path)
    assert len(rows["train"]) == 2 and rows["train"][0]["kl"] > 0
