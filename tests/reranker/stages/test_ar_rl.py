"""`ar_rl` (DAPO): first ratios are 1, dynamic sampling keeps the first P informative groups, and on a
toy task the reward goes up. `make_toy_rl_world` is shared with test_rl.

The toy task: two prompts of two candidates each, target second in the retriever order. A tiny model
is SFT'd on both answers of each prompt equally: "promote the target" (valid, reward 0.5 + α = 0.7)
and "copy the retriever order" (valid, reward 0); sampling at T = 1 also yields some invalid answers
(−1). RL must move the policy to the promoting answer.
"""
import json
import math

import pytest
import torch

from test_sft import make_sft_world
from reranker.text.sid import format_sid

torch.set_num_threads(1)

CANDIDATES = [[format_sid([1, 2, 3, 4]), format_sid([5, 6, 7, 0])],
              [format_sid([2, 2, 1, 1]), format_sid([7, 1, 0, 3])]]
PROMOTE, COPY = [1, 0], [0, 1]


def toy_record(cands, order, target=1):
    msgs = [{"role": "system", "content": "Re-rank."}, {"role": "user", "content": " ".join(cands)}]
    return {"prompt_messages": msgs, "candidate_sids": cands, "target_index": target,
            "assistant": "<think>\nyes\n</think>\n" + json.dumps({"ranking": [cands[i] for i in order]})}


def make_toy_rl_world(root, sft_steps=250, seed=0, copies=2):
    """(model dir, data dir): the tiny SFT world's tokenizer/model, SFT'd on the toy answers, copying
    twice as often as promoting (so greedy decoding copies: R@1 = 0 before RL)."""
    from transformers import AutoTokenizer

    from reranker.model import load_model, save_model
    from reranker.training.batches import collate, encode_examples, weighted_nll

    init, _ = make_sft_world(root / "base", n_train=4, n_valid=1, seed=seed)
    tok = AutoTokenizer.from_pretrained(str(init))
    model = load_model(init).train()
    records = [toy_record(c, o) for c in CANDIDATES for o in [PROMOTE] + [COPY] * copies]
    enc, _ = encode_examples(tok, records, 256)
    b = collate(enc, tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(sft_steps):
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
        loss, st = weighted_nll(logits, b["labels"], b["loss_weights"])
        (loss / st["tokens"]).backward()
        opt.step()
        opt.zero_grad()
    save_model(model.eval(), tok, root / "toy")
    data = root / "toy_data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [toy_record(c, PROMOTE) for c in CANDIDATES]  # the assistant text is not used by RL
    for name in ("train", "valid"):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "toy", data


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_rl_world(tmp_path_factory.mktemp("toy_rl"))


def _setup(model_dir, data):
    from transformers import AutoTokenizer

    from reranker.model import load_model
    from reranker.rl.rollouts import Scorer, load_prompts
    from reranker.training.batches import read_jsonl

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir)
    prompts, skipped = load_prompts(tok, read_jsonl(data / "train.jsonl"), 256)
    assert skipped == 0 and len(prompts) == 2
    return tok, model, Scorer(tok), prompts


def test_first_ppo_epoch_ratios_are_one(toy):
    from reranker.rl.policy_gradient import policy_loss
    from reranker.rl.rollouts import generate_rollouts, pad_samples
    from reranker.stages.ar_rl import ARPolicy

    tok, model, scorer, prompts = _setup(*toy)
    policy = ARPolicy(scorer.eos_id, scorer.pad_id, 48, temperature=1.0)
    groups = generate_rollouts(policy, model, prompts, 4, scorer, torch.Generator().manual_seed(3), batch_size=5)
    rollouts = [r for g in groups for r in g]
    assert {len(r.sample.tokens) for r in rollouts} != {48}  # rows stop at EOS at different lengths
    assert {round(r.reward, 6) for r in rollouts} >= {0.0, 0.7}  # both answers sampled
    model.train()
    samples = [r.sample for r in rollouts]
    old, act = pad_samples(samples, "cpu")
    new = policy.logprobs(model, [prompts[r.prompt].ids for r in rollouts], samples)
    assert new.requires_grad and new.shape == old.shape
    torch.testing.assert_close(new.detach()[act], old[act], atol=1e-5, rtol=0)
    _, st = policy_loss(new, old, torch.ones(len(samples)), act)
    assert st["ratio_dev_max"] < 1e-5 and st["clipped_tokens"] == 0
    assert st["tokens"] == sum(len(s.tokens) for s in samples)  # every generated token (EOS included) acts


def test_dynamic_sampling_keeps_the_first_informative_groups():
    """Groups with equal rewards are dropped; more prompts are drawn until P groups are kept (or the
    round cap); exactly P are used, in draw order. A stub decoder/scorer makes rewards a function of
    the prompt: prompts 0-5 give a constant reward, 6-9 a varied one."""
    from reranker.rl.rollouts import RLPrompt, Sample, collect
    from reranker.text.answer import ParseResult
    from reranker.training.policy_optimization import RLState

    class Stub:
        name = "stub"

        def sample(self, model, prompt_ids, generator, greedy=False):
            return [Sample([p[0], int(torch.randint(0, 2, (1,), generator=generator))], torch.zeros(2),
                           torch.ones(2, dtype=torch.bool)) for p in prompt_ids]

    def scorer(prompt, tokens):
        reward = float(tokens[1]) if tokens[0] >= 6 else 0.5
        return "", ParseResult((0, 1), None), reward

    prompts = [RLPrompt([i], ["a", "b"], 1) for i in range(10)]
    cfg = {"prompts_per_step": 3, "group_size": 6, "max_draw_rounds": 4, "rollout_batch_size": 7}
    state = RLState()
    kept, n, stats = collect(Stub(), torch.nn.Linear(1, 1), prompts, state, cfg, scorer, 0, 0, 1, "cpu")
    assert n == 3 and len(kept) == 3 and sorted(s for s, _, _ in kept) == [0, 1, 2]
    assert all(p.ids[0] >= 6 for _, p, _ in kept)
    assert stats["prompts_drawn"] == 3 * stats["draw_rounds"] and stats["draw_rounds"] >= 2
    assert 0 < stats["kept_frac"] < 1
    assert state.epoch * 10 + state.cursor == stats["prompts_drawn"]  # the stream moved on
    cfg["max_draw_rounds"] = 1  # the cap: fewer than P groups may be all there is
    state = RLState(epoch=5)
    _, n1, stats1 = collect(Stub(), torch.nn.Linear(1, 1), prompts, state, cfg, scorer, 0, 0, 1, "cpu")
    assert stats1["draw_rounds"] == 1 and n1 == stats1["groups_used"] <= 3


def _log_odds_promote(model_dir, data):
    """log p(promoting answer) − log p(copying answer), teacher-forced, summed over the toy prompts."""
    from reranker.stages.ar_rl import teacher_forced_logprobs

    tok, model, scorer, prompts = _setup(model_dir, data)
    total = 0.0
    with torch.no_grad():
        for p, c in zip(prompts, CANDIDATES):
            resp = [tok(toy_record(c, o)["assistant"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
                    for o in (PROMOTE, COPY)]
            lp = teacher_forced_logprobs(model, [p.ids, p.ids], resp, scorer.pad_id)
            total += float(lp[0, :len(resp[0])].sum() - lp[1, :len(resp[1])].sum())
    return total


def test_ar_rl_raises_the_reward_end_to_end(toy, tmp_path):
    from transformers import AutoModelForCausalLM

    from reranker.stages.pipeline import run_stage
    from reranker.training.logging import read_metrics

    model_dir, data = toy
    cfg = {"steps": 10, "prompts_per_step": 2, "group_size": 8, "max_new_tokens": 48, "lr": 1e-3,
           "eval_every": 5, "eval_batch_size": 2, "save_every": 2, "micro_batch_size": 8, "max_prompt_len": 256}
    out, run = tmp_path / "ar_rl", tmp_path / "run"
    s = run_stage("ar_rl", model_dir, out, data, cfg, run_dir=run, progress=False, device="cpu")
    assert s["status"] == "done"
    train = read_metrics(run, "train")
    assert [r["step"] for r in train] == list(range(1, 11))
    assert all(0 <= r["kept_frac"] <= 1 and 0 <= r["copy_rate"] <= 1 for r in train)
    assert all(r["ratio_dev_max_on_policy"] < 1e-4 for r in train if "loss" in r)
    # Step 1's rollouts come from the SFT policy, before any update; the policy moves within a step
    # or two, so compare that step with the second half of the run. Rewards are noisy (16 samples at
    # T = 1, invalid ones cost -1 whatever the policy prefers), so the margin is what the move from
    # copying (reward 0) to promoting (0.7) buys even with that noise; a policy that stops learning
    # keeps its step-1 mean.
    rewards = [r["reward_mean"] for r in train]
    assert sum(rewards[5:]) / 5 > rewards[0] + 0.1, rewards
    assert train[0]["copy_rate"] > 0.3 and max(r["copy_rate"] for r in train[-3:]) < 0.1
    valid = read_metrics(run, "valid")  # greedy: copies before RL, promotes the target after
    assert [r["step"] for r in valid] == [0, 5, 10]
    assert valid[0]["r1"] == 0.0 and valid[0]["copy_rate"] == 1.0
    assert valid[-1]["r1"] == 1.0 and valid[-1]["valid_rate"] == 1.0
    done = json.loads((out / "stage_done.json").read_text())
    assert done["optimizer_steps"] == s["optimizer_steps"] == sum(r.get("optimizer_steps", 0) for r in train) > 0
    assert done["metrics"]["best_valid_r1"] == 1.0
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.hidden_size == 32
    # the trained policy prefers promoting the target, more than the SFT model did
    assert _log_odds_promote(out, data) > _log_odds_promote(model_dir, data) + 1.0
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert math.isfinite(train[-1]["loss"])
