"""DAPO/GRPO policy optimization of a re-ranker: the RL loop both RL stages share; the policy (its
decoder: AR in stages/ar_rl.py, block diffusion in stages/rl.py) is the only thing they change.

One iteration (steps 1-2: rollouts.collect; step 3: update):
  1. Draw `prompts_per_step` prompts (a seeded, epoch-wise shuffled stream), sample `group_size`
     rollouts of each with the policy's decoder, parse, reward (GR2: R_rank + α·R_fmt, −1 invalid).
  2. DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no signal);
     draw more prompts until `prompts_per_step` groups are kept or `max_draw_rounds` rounds are
     drawn, then keep the first `prompts_per_step` (in draw order).
  3. Group-normalized advantages; `ppo_epochs` x `mini_batches` optimizer steps on the clipped
     surrogate (ε_low / ε_high), token-level normalized over the mini-batch's action tokens.
     logp_old is what the decoder recorded while sampling; logp_new is the policy's `logprobs`
     under the current weights (with the default ppo_epochs = 1 the update is on-policy).
Validation: greedy decode of the valid prompts -> R@1 (invalid answers fall back to the order the
prompt listed, as in evaluation), valid rate, copy rate; the output is the model with the best valid
(R@1, valid rate), the input model included (iteration 0).

A policy has `name`, `sample(model, prompt_ids, generator, greedy=False)` -> rollouts.Sample per
prompt, and `logprobs(model, prompt_ids, samples)` -> (b, L) log-probs with gradients.

Data parallel without the DDP wrapper: each rank decodes its share of every draw round and
back-propagates its rollouts' loss divided by the GLOBAL action-token count; gradients are then
summed over ranks with one all-reduce (distributed.sum_gradients). Done by hand because the
diffusion replay calls the model several times per backward (chunked windows), which DDP's reducer
does not allow, and the decoding helpers need the bare module. Sampling is seeded per (seed,
iteration, round, rank), so a resumed run redraws exactly what the interrupted one drew.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from reranker.model import load_model
from reranker.rl.policy_gradient import group_advantages, policy_loss
from reranker.rl.rollouts import Scorer, collect, load_prompts, pad_samples, validate_policy

from . import distributed as D
from .batches import read_jsonl
from .checkpoint import TrainState, fault_point
from .recipe import Run, load_model_and_tokenizer, optimizer_and_scheduler, optimizer_step, setup

# The loop's config keys; each RL stage adds its decoder's (ar_rl: top_p; rl: τ, block size, ...).
DEFAULTS = {
    "train_file": "train.jsonl",  # relative to the data dir; rows need prompt_messages + target_index
    "valid_file": "valid.jsonl",  # null or missing: no validation, the last model is the output
    "sids_file": "sids.json",  # item -> SID map, only for rows without candidate_sids
    "max_train_examples": None,
    "max_valid_examples": 64,
    "max_prompt_len": 1024,  # longer prompts lose tokens from the left, as in SFT
    "max_new_tokens": 320,
    "steps": 100,  # iterations (rollout batches); optimizer steps = steps x ppo_epochs x mini_batches
    "prompts_per_step": 8,  # kept groups per iteration (global, any world size)
    "group_size": 8,  # G rollouts per prompt
    "max_draw_rounds": 3,  # dynamic-sampling cap: at most this many draws of prompts_per_step prompts
    "rollout_batch_size": 64,  # sequences per batched decode call
    "micro_batch_size": 16,  # rollouts per forward/backward (memory); does not change the math
    "ppo_epochs": 1,
    "mini_batches": 1,
    "temperature": 1.0,  # sampling temperature; log-probs are under softmax(logits / T)
    "eps_low": 0.2,
    "eps_high": 0.28,  # DAPO clip-higher
    "adv_eps": 1e-6,
    "alpha": 0.2,  # format-reward weight
    "kl_coef": 0.0,  # β of the k3 KL to the reference; 0 = off (DAPO drops it)
    "reference_dir": None,  # reference model for the KL; default the input model
    "lr": 2e-5,
    "warmup_steps": 0,
    "min_lr_ratio": 1.0,  # 1.0: constant after warm-up
    "weight_decay": 0.0,
    "betas": [0.9, 0.99],
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "dtype": "float32",
    "eval_every": 10,  # iterations between validations (plus one before training and one at the end)
    "eval_batch_size": 16,
    "select_best": True,  # output the best-validation model (else the last one)
    "save_every": 5,  # iterations between checkpoints (plus one after every validation)
    "keep_checkpoints": 2,
    "resume": True,
}


def check_config(cfg: dict) -> None:
    for k in ("steps", "prompts_per_step", "group_size", "max_draw_rounds", "ppo_epochs", "mini_batches",
              "micro_batch_size", "rollout_batch_size", "max_new_tokens"):
        if int(cfg[k]) < (0 if k == "steps" else 1):
            raise ValueError(f"{k} must be >= {0 if k == 'steps' else 1}, got {cfg[k]}")
    if int(cfg["group_size"]) < 2:
        raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), got {cfg['group_size']}")
    if not float(cfg["temperature"]) > 0:
        raise ValueError(f"temperature must be > 0 for RL rollouts, got {cfg['temperature']}")
    if not (0 <= float(cfg["eps_low"]) < 1 and float(cfg["eps_high"]) >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {cfg['eps_low']}, {cfg['eps_high']}")


@dataclass
class RLState(TrainState):
    """TrainState (step = optimizer steps, epoch = prompt-stream epoch) plus the RL loop position."""
    iteration: int = 0
    cursor: int = 0  # prompts consumed in the current epoch of the stream
    best_r1: float = -1.0
    best_valid_rate: float = -1.0


# ---------------------------------------------------------------------------- one update

def update(policy, model, ref_model, opt, sched, batch, n_groups, state, cfg, device) -> dict:
    """Step 3 of the module docstring on this rank's share `batch` of the n_groups kept groups."""
    if n_groups == 0:
        return {}
    nmb, eps_adv = int(cfg["mini_batches"]), float(cfg["adv_eps"])
    items = []  # (mini-batch, prompt ids, sample, advantage)
    for s, p, g in batch:
        adv = group_advantages(torch.tensor([[r.reward for r in g]]), eps_adv)[0]
        items += [(s * nmb // n_groups, p.ids, r.sample, float(a)) for r, a in zip(g, adv)]
    micro = int(cfg["micro_batch_size"])
    kl_coef = float(cfg["kl_coef"])
    ref_lp = {}
    if ref_model is not None and kl_coef:
        with torch.no_grad():
            for a in range(0, len(items), micro):
                chunk = items[a:a + micro]
                lp = policy.logprobs(ref_model, [c[1] for c in chunk], [c[2] for c in chunk])
                for i, c in enumerate(chunk):
                    ref_lp[id(c[2])] = lp[i, :len(c[2].logprobs)]
    agg = {"loss": 0.0, "tokens": 0.0, "ratio_sum": 0.0, "clipped_tokens": 0.0, "approx_kl_sum": 0.0,
           "kl_ref_sum": 0.0, "grad_norm": 0.0, "optimizer_steps": 0}
    first_dev = 0.0
    for epoch in range(int(cfg["ppo_epochs"])):
        for mb in range(nmb):
            mine = [it for it in items if it[0] == mb]
            n_tok = D.all_reduce_sum([sum(int(it[2].actions.sum()) for it in mine)], device)[0]
            if n_tok == 0:
                continue
            opt.zero_grad(set_to_none=True)
            sums = [0.0] * 6  # loss, tokens, ratio, clipped, approx kl, kl ref
            for a in range(0, len(mine), micro):
                chunk = mine[a:a + micro]
                samples = [c[2] for c in chunk]
                old, act = pad_samples(samples, device)
                new = policy.logprobs(model, [c[1] for c in chunk], samples)[:, :old.shape[1]]
                ref = None
                if ref_lp:
                    ref = torch.zeros_like(old)
                    for i, s in enumerate(samples):
                        ref[i, :len(s.logprobs)] = ref_lp[id(s)]
                adv = torch.tensor([c[3] for c in chunk], device=device)
                loss_sum, st = policy_loss(new, old, adv, act, float(cfg["eps_low"]), float(cfg["eps_high"]),
                                           ref, kl_coef)
                (loss_sum / n_tok).backward()
                if epoch == 0 and mb == 0:  # before this iteration's first update: must be ~0
                    first_dev = max(first_dev, st["ratio_dev_max"])
                parts = [float(loss_sum.detach()), st["tokens"], st["ratio_sum"], st["clipped_tokens"],
                         st["approx_kl_sum"], st["kl_ref_sum"]]
                sums = [x + y for x, y in zip(sums, parts)]
            D.sum_gradients(model)
            gn, _ = optimizer_step(model, opt, sched, cfg["max_grad_norm"])
            state.step += 1
            loss, tok, ratio, clipped, akl, kref = D.all_reduce_sum(sums, device)
            for k, v in zip(("loss", "tokens", "ratio_sum", "clipped_tokens", "approx_kl_sum", "kl_ref_sum",
                             "grad_norm"), (loss / n_tok, tok, ratio, clipped, akl, kref, gn)):
                agg[k] += v
            agg["optimizer_steps"] += 1
    k, tok = max(agg["optimizer_steps"], 1), max(agg["tokens"], 1)
    first_dev = max(D.all_gather_object(first_dev))
    return {"loss": agg["loss"] / k, "grad_norm": agg["grad_norm"] / k, "ratio_mean": agg["ratio_sum"] / tok,
            "clip_frac": agg["clipped_tokens"] / tok, "approx_kl": agg["approx_kl_sum"] / tok,
            "kl_ref": agg["kl_ref_sum"] / tok, "ratio_dev_max_on_policy": first_dev,
            "action_tokens": agg["tokens"] / max(int(cfg["ppo_epochs"]), 1), "optimizer_steps": agg["optimizer_steps"]}


# ---------------------------------------------------------------------------- the loop

def train_policy(ctx, make_policy, check=check_config) -> tuple[dict, int]:
    """The RL recipe; `make_policy(model, scorer, cfg)` picks the decoder (AR in ar_rl, diffusion in
    rl). Returns (the stage metrics, optimizer steps)."""
    cfg, device = setup(ctx, check)
    rank, world = ctx.rank, ctx.world_size
    model, tok = load_model_and_tokenizer(ctx.input_dir, cfg["dtype"], device)
    model.train()
    scorer = Scorer(tok, float(cfg["alpha"]))
    policy = make_policy(model, scorer, cfg)
    ref_model = None
    if float(cfg["kl_coef"]):
        ref_model = load_model(cfg["reference_dir"] or ctx.input_dir, dtype=getattr(torch, cfg["dtype"]),
                               device=device).eval().requires_grad_(False)

    data_dir = Path(ctx.data_dir) if ctx.data_dir is not None else Path(".")
    max_prompt = int(cfg["max_prompt_len"])
    sids_path = data_dir / cfg["sids_file"] if cfg["sids_file"] else None
    train, skipped = load_prompts(tok, read_jsonl(data_dir / cfg["train_file"], cfg["max_train_examples"]),
                                  max_prompt, sids_path)
    if not train:
        raise ValueError(f"no training prompt with a target_index in {data_dir / cfg['train_file']}")
    valid = []
    if cfg["valid_file"] and (data_dir / cfg["valid_file"]).is_file():
        valid, _ = load_prompts(tok, read_jsonl(data_dir / cfg["valid_file"], cfg["max_valid_examples"]),
                                max_prompt, sids_path)

    steps = int(cfg["steps"])
    max_opt_steps = max(1, steps * int(cfg["ppo_epochs"]) * int(cfg["mini_batches"]))
    opt, sched = optimizer_and_scheduler(model, cfg, int(cfg["warmup_steps"]), max_opt_steps)
    run = Run(ctx, model, tok, opt, sched, steps, state_cls=RLState, position="iteration")
    state, log = run.state, run.log
    if not run.resumed:
        log.log(0, "data", {"train_prompts": len(train), "skipped_without_target": skipped,
                            "valid_prompts": len(valid), "world_size": world})

    def validate():
        m = validate_policy(policy, model, valid, scorer, int(cfg["eval_batch_size"]), rank, world, device)
        state.last_val = m
        state.validated_step = state.iteration
        log.log(state.iteration, "valid", m)
        improved = (m["r1"], m["valid_rate"]) > (state.best_r1, state.best_valid_rate) or not cfg["select_best"]
        if improved:
            state.best_r1, state.best_valid_rate, state.best_step = m["r1"], m["valid_rate"], state.iteration
        run.keep_best(improved)
        run.snapshot()

    if valid and state.validated_step < 0:
        validate()  # the input model is a candidate for "best": RL must earn its place
    while state.iteration < steps:
        t0 = time.perf_counter()
        batch, n_groups, roll = collect(policy, model, train, state, cfg, scorer, ctx.seed, rank, world, device)
        t1 = time.perf_counter()
        lr = sched.get_last_lr()[0]
        upd = update(policy, model, ref_model, opt, sched, batch, n_groups, state, cfg, device)
        state.iteration += 1
        log.log(state.iteration, "train", {**roll, **upd, "lr": lr, "optimizer_step": state.step,
                                           "rollout_seconds": t1 - t0, "update_seconds": time.perf_counter() - t1})
        log.progress(1, reward=roll["reward_mean"], valid=roll["valid_rate"], kept=roll["kept_frac"])
        state.last_train_loss = upd.get("loss", state.last_train_loss)
        last = state.iteration == steps
        if valid and (last or (cfg["eval_every"] and state.iteration % int(cfg["eval_every"]) == 0)):
            validate()
        elif last or (cfg["save_every"] and state.iteration % int(cfg["save_every"]) == 0):
            run.snapshot()
        fault_point(state.iteration)

    last = state.last_val or {}
    metrics = run.finish(bool(valid), {
        "best_valid_r1": state.best_r1 if valid else None,
        "best_valid_rate": state.best_valid_rate if valid else None,
        "best_iteration": state.best_step if valid else state.iteration,
        "last_valid_r1": last.get("r1"), "last_valid_rate": last.get("valid_rate"),
        "last_valid_copy_rate": last.get("copy_rate"), "iterations": state.iteration,
        "train_prompts": len(train), "valid_prompts": len(valid), "decoder": policy.name,
    }, resumed_key="resumed_from_iteration")
    return metrics, state.step
