"""`rl` (TraceRL-style GRPO on the block-diffusion model).

Acceptance: while the weights are unchanged, replaying each rollout's recorded trajectory gives the
log-probs the decoder recorded (within 1e-5), so the first importance ratios are 1. Plus: the stage
runs end to end on a tiny converted world, and a run interrupted mid-stage resumes to the same
optimizer-step count (and the same curves).

The world: the toy task of test_ar_rl (two prompts, promote-vs-copy answers 1:1), the tiny model
converted to block diffusion (B = 4) and given a short CFT (masked-diffusion loss) so that the
diffusion decoder's rollouts are a mix of valid and invalid answers: groups have reward variance,
blocks take several steps, and the last block holds committed tokens after EOS.
"""
import json

import pytest
import torch

from test_ar_rl import CANDIDATES, COPY, PROMOTE, make_toy_rl_world, toy_record
from reranker.stages.pipeline import run_stage
from reranker.training.logging import read_metrics

torch.set_num_threads(1)
B = 4


def make_toy_diffusion_world(root, cft_steps=150, seed=0):
    from reranker.diffusion.convert import convert_to_diffusion
    from reranker.diffusion.loss import diffusion_loss
    from reranker.diffusion.masks import pack_prompt_response
    from reranker.model import save_model
    from reranker.training.batches import encode_examples

    ar_dir, data = make_toy_rl_world(root, sft_steps=0, seed=seed, copies=1)
    model, tok = convert_to_diffusion(ar_dir, root / "converted", block_size=B)
    enc, _ = encode_examples(tok, [toy_record(c, o) for c in CANDIDATES for o in (PROMOTE, COPY)], 256)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids, plen, rlen = pack_prompt_response([e.input_ids[:e.n_prompt] for e in enc],
                                           [e.input_ids[e.n_prompt:] for e in enc], tok.pad_token_id, B, eos)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(cft_steps):
        loss = diffusion_loss(model, ids, plen, rlen, B, model.config.diffusion["mask_token_id"],
                              complementary=True, generator=g)
        loss.backward()
        opt.step()
        opt.zero_grad()
    save_model(model.eval(), tok, root / "cft")
    return root / "cft", data


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_toy_diffusion_world(tmp_path_factory.mktemp("toy_diffusion"))


def _policy(model_dir, data, **overrides):
    from transformers import AutoTokenizer

    from reranker.model import load_model
    from reranker.rl.rollouts import Scorer, load_prompts
    from reranker.stages.rl import DEFAULTS, make_diffusion_policy
    from reranker.training.batches import read_jsonl

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir)
    scorer = Scorer(tok)
    prompts, _ = load_prompts(tok, read_jsonl(data / "train.jsonl"), 256)
    policy = make_diffusion_policy(model, scorer, {**DEFAULTS, "max_new_tokens": 32, **overrides})
    return model, scorer, prompts, policy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_replayed_logprobs_equal_recorded_so_first_ratios_are_one(world, temperature):
    from reranker.rl.policy_gradient import policy_loss
    from reranker.rl.rollouts import generate_rollouts, pad_samples

    model, scorer, prompts, policy = _policy(*world, temperature=temperature)
    assert policy.block_size == B and policy.tau == 0.9  # as served: the model's block size, τ = 0.9
    groups = generate_rollouts(policy, model, prompts, 8, scorer, torch.Generator().manual_seed(1), batch_size=16)
    rollouts = [r for g in groups for r in g]
    trajs = [r.sample.trajectory for r in rollouts]
    # The test means something: multi-step blocks, tokens committed after EOS, mixed rewards.
    assert max(int(t.steps.max()) for t in trajs) >= 2
    assert any(bool((t.committed & ~t.kept).any()) for t in trajs)
    assert len({r.reward for r in rollouts}) > 1
    model.train()  # training mode: what the stage replays under
    samples = [r.sample for r in rollouts]
    old, act = pad_samples(samples, "cpu")
    new = policy.logprobs(model, [prompts[r.prompt].ids for r in rollouts], samples)
    assert new.requires_grad and new.shape == old.shape
    committed = torch.zeros_like(act)
    for i, t in enumerate(trajs):
        committed[i, :len(t.steps)] = t.committed
    torch.testing.assert_close(new.detach()[committed], old[committed], atol=1e-5, rtol=0)
    loss, st = policy_loss(new, old, torch.randn(len(samples)), act, 0.2, 0.2)
    assert st["ratio_dev_max"] < 1e-5 and st["clipped_tokens"] == 0
    # actions: committed and kept (through the first EOS); the discarded tail is not scored
    assert (act <= committed).all() and act.sum() < committed.sum()
    assert st["tokens"] == sum(int((t.committed & t.kept).sum()) for t in trajs)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_committed_action_option_scores_every_committed_token(world):
    from reranker.rl.rollouts import generate_rollouts

    model, scorer, prompts, policy = _policy(*world, action_tokens="committed")
    (g,) = generate_rollouts(policy, model, prompts[:1], 4, scorer, torch.Generator().manual_seed(2))
    for r in g:
        assert torch.equal(r.sample.actions, r.sample.trajectory.committed)


def test_rl_refuses_an_unconverted_model(world):
    from transformers import AutoTokenizer

    from reranker.model import load_model
    from reranker.rl.rollouts import Scorer
    from reranker.stages.rl import DEFAULTS, make_diffusion_policy

    ar_dir = world[0].parent / "toy"  # the AR model the world was converted from
    with pytest.raises(ValueError, match="convert"):
        make_diffusion_policy(load_model(ar_dir), Scorer(AutoTokenizer.from_pretrained(str(ar_dir))), DEFAULTS)


CFG = {"steps": 4, "prompts_per_step": 2, "group_size": 4, "max_draw_rounds": 2, "max_new_tokens": 32,
       "lr": 1e-3, "eval_every": 2, "eval_batch_size": 2, "save_every": 2, "micro_batch_size": 4,
       "max_prompt_len": 256}


@pytest.fixture(scope="module")
def full_run(world, tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_full")
    s = run_stage("rl", world[0], root / "out", world[1], CFG, run_dir=root / "run", progress=False, device="cpu")
    return s, root


def test_rl_stage_end_to_end(full_run):
    from transformers import AutoModelForCausalLM

    from reranker.diffusion.convert import load_diffusion_config

    s, root = full_run
    assert s["status"] == "done" and s["optimizer_steps"] > 0
    done = json.loads((root / "out" / "stage_done.json").read_text())
    assert done["stage"] == "rl" and done["optimizer_steps"] == s["optimizer_steps"]
    assert done["metrics"]["decoder"] == "diffusion" and done["metrics"]["iterations"] == 4
    train = read_metrics(root / "run", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert sum(r.get("optimizer_steps", 0) for r in train) == s["optimizer_steps"]
    assert all(r["ratio_dev_max_on_policy"] < 1e-4 for r in train if "loss" in r)
    assert [r["step"] for r in read_metrics(root / "run", "valid")] == [0, 2, 4]
    model = AutoModelForCausalLM.from_pretrained(str(root / "out"))
    assert load_diffusion_config(model)["block_size"] == B  # still a diffusion model
    assert not (root / "out.partial").exists()


class Interrupted(Exception):
    pass


def test_interrupted_rl_resumes_to_the_same_steps(world, full_run, tmp_path, monkeypatch):
    import reranker.training.policy_optimization as loop

    ref, ref_root = full_run
    real = loop.fault_point

    def crash_after_3(iteration):
        if iteration == 3:  # checkpoints exist for iteration 2; iteration 3 ran and is lost
            raise Interrupted
        real(iteration)

    monkeypatch.setattr(loop, "fault_point", crash_after_3)
    with pytest.raises(Interrupted):
        run_stage("rl", world[0], tmp_path / "out", world[1], CFG, run_dir=tmp_path / "run", progress=False,
                  device="cpu")
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").is_dir()
    monkeypatch.setattr(loop, "fault_point", real)
    res = run_stage("rl", world[0], tmp_path / "out", world[1], CFG, run_dir=tmp_path / "run", progress=False,
                    device="cpu")
    assert res["status"] == "done" and res["metrics"]["resumed_from_iteration"] == 2
    assert res["optimizer_steps"] == ref["optimizer_steps"]
    a, b = read_metrics(ref_root / "run", "train"), read_metrics(tmp_path / "run", "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # the lost iteration 3 is logged once, redone
    for x, y in zip(a, b):  # same draws (seeded per iteration), same updates
        assert x["reward_mean"] == y["reward_mean"] and x.get("optimizer_step") == y.get("optimizer_step")


def test_replay_matches_decoding_under_the_prefix_commit_rule(world):
    """Replay rebuilds each canvas from the recorded steps, so it holds for any commit rule."""
    from reranker.rl.rollouts import generate_rollouts, pad_samples

    model, scorer, prompts, policy = _policy(*world, temperature=1.0)
    policy.commit_rule = "prefix"
    groups = generate_rollouts(policy, model, prompts, 4, scorer, torch.Generator().manual_seed(2), batch_size=8)
    rollouts = [r for g in groups for r in g]
    samples = [r.sample for r in rollouts]
    for s in samples:  # left to right inside every block
        st = s.trajectory.steps.view(-1, B)
        for row in st:
            row = row[row >= 0].tolist()
            assert row == sorted(row)
    assert max(int(s.trajectory.steps.max()) for s in samples) >= 1
    old, _ = pad_samples(samples, "cpu")
    new = policy.logprobs(model, [prompts[r.prompt].ids for r in rollouts], samples).detach()
    committed = torch.zeros_like(old, dtype=torch.bool)
    for i, s in enumerate(samples):
        committed[i, :len(s.trajectory.steps)] = s.trajectory.committed
    torch.testing.assert_close(new[committed], old[committed], atol=1e-5, rtol=0)
    from reranker.stages.rl import DEFAULTS, check_config

    with pytest.raises(ValueError, match="commit_rule"):
        check_config({**DEFAULTS, "commit_rule": "nope"})
