"""CFT: conversion fine-tuning of the block-diffusion re-ranker (masked-diffusion loss, 3 epochs).

    loss = sum over response targets of  w_i * 1[y_i masked] * CE(y_i) / t   /   N

(reranker.diffusion.loss: one [x_0 ; x_t] forward, t ~ U(eps, 1) per example), with w = λ_r on
reasoning tokens, λ_o on answer tokens and `fill_weight` on the EOS fill, N = response tokens
(fill included) of the whole global batch. Responses are padded to whole blocks with EOS: the
decoder always shows the model a full last block (mask tokens after the answer's EOS), so training
"EOS after EOS" keeps that block in distribution and lets the decoder commit the tail in one
confident step. The fill's default weight is λ_o: it is part of the output format the decoder must
get right (a non-EOS token there is committed and can end up in the trajectory), and it is cheap.

Noise (t and the mask of each example) is drawn from a generator keyed by (seed, step, example
index), so a resumed run, a different world size or a different micro-batch split sees the very
same noisy inputs.

Input: a converted model dir (config.diffusion); a plain AR dir is converted first (logged).
Same loop contract as sft: global batch independent of world size, resumable checkpoints,
validation each epoch (diffusion loss under a FIXED noise draw, so epochs are comparable, plus an
optional greedy τ-decode of a few validation prompts: valid-JSON rate and token accuracy), best
model written as the output. Gradients are summed over ranks explicitly
(training.distributed.sum_gradients) instead of through a DDP wrapper: diffusion_loss / replay call
the model's own attributes (dtype, config), which a DDP wrapper hides, and an explicit all-reduce
gives exactly the 1-process gradient.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from reranker.decoding import served_rollout_settings
from reranker.diffusion import diffusion_decode
from reranker.diffusion.loss import diffusion_loss, sample_noise
from reranker.diffusion.masks import pack_prompt_response
from reranker.stages.base import Stage, StageContext, StageResult
from reranker.training import distributed as D
from reranker.training.batches import token_ids
from reranker.training.candidates import load_split, valid_json
from reranker.training.loop import after_step, epoch_plan, scheduled_batches
from reranker.training.precision import autocast, check_autocast
from reranker.training.recipe import Run, load_diffusion_model, optimizer_and_scheduler, optimizer_step, setup
from reranker.training.schedule import warmup_steps_from

DEFAULTS = {
    "train_file": "train.jsonl",
    "valid_file": "valid.jsonl",
    "max_train_examples": None,
    "max_valid_examples": None,
    "max_len": 1024,
    "block_size": None,  # None: the model's config.diffusion.block_size (32 when converting an AR dir)
    "epochs": 3,
    "max_steps": None,
    "batch_size": 16,  # global examples per optimizer step
    "grad_accum": 1,
    "micro_batch_size": None,
    "eval_batch_size": 8,
    "lr": 5e-4,
    "min_lr_ratio": 0.1,
    "warmup_ratio": 0.05,
    "warmup_steps": None,
    "weight_decay": 0.01,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "lambda_r": 0.5,
    "lambda_o": 1.0,
    "fill_weight": None,  # weight of the EOS fill after the response; None: lambda_o
    "complementary": False,  # two complementary noisy copies per example (diffusion_loss)
    "suffix_fraction": 0.0,  # share of examples with block-suffix masks (what the prefix commit rule decodes from)
    "t_eps": 1e-3,
    "valid_noise_seed": 1234,  # the fixed noise draw of every validation
    "decode_examples": 16,  # greedy τ-decode of this many validation prompts per validation; 0: off
    "decode_tau": None,  # None: the model's recorded tau (reranker.decoding); its commit rule is used too
    "decode_max_new_tokens": None,  # None: longest reference response of those prompts + one block
    "dtype": "float32",
    "autocast": "none",  # "bf16": bfloat16 matmuls in the training forward, fp32 weights (training/precision.py)
    "save_every": 50,
    "keep_checkpoints": 2,
    "eval_every": None,
    "resume": True,
}


def cft_batch(examples, pad_id, eos_id, B, lam_r, lam_o, fill_w, device):
    """(input_ids, prompt_len, resp_len, token_weights) with responses EOS-filled to whole blocks."""
    prompts = [e.input_ids[:e.n_prompt] for e in examples]
    responses = [e.input_ids[e.n_prompt:] for e in examples]
    ids, plen, rlen = pack_prompt_response(prompts, responses, pad_id, block_size=B, fill_id=eos_id)
    w = torch.zeros(len(examples), int(rlen.max()))
    for i, e in enumerate(examples):
        w[i, :e.n_reasoning] = lam_r
        w[i, e.n_reasoning:e.n_supervised] = lam_o
        w[i, e.n_supervised:int(rlen[i])] = fill_w
    return ids.to(device), plen.to(device), rlen.to(device), w.to(device)


def example_noise(keys, rlen, complementary, eps, device, block_size=None, suffix_fraction=0.0):
    """(t (C, b), target masks (C, b, max rlen)) with each example's draw keyed by its own key:
    the noise of an example never depends on which batch, micro-batch or rank it lands in."""
    ts, ms = [], []
    L = int(rlen.max())
    for key, n in zip(keys, rlen.tolist()):
        t, m = sample_noise(torch.tensor([n]), n, eps, complementary, D.seeded("cpu", *key),
                            block_size=block_size, suffix_prob=suffix_fraction)
        ts.append(t)
        ms.append(torch.nn.functional.pad(m, (0, L - n)))
    return torch.cat(ts, 1).to(device), torch.cat(ms, 1).to(device)


def padded_len(e, B) -> int:
    return math.ceil(e.n_supervised / B) * B


@torch.no_grad()
def evaluate_loss(model, examples, cfg, ids, B, mask_id, device, rank=0, world=1) -> float:
    """Diffusion loss per response token under a fixed noise draw: each example's t and mask are
    keyed by (valid_noise_seed, example index), so every validation (and any world size) sees the
    very same noisy inputs and only the weights change between epochs."""
    was = model.training
    model.eval()
    eos, pad = ids
    mine = sorted(D.shard(list(range(len(examples))), rank, world), key=lambda i: len(examples[i].input_ids))
    total, count = 0.0, 0.0
    bs = int(cfg["eval_batch_size"])
    for s in range(0, len(mine), bs):
        idx = mine[s:s + bs]
        x, plen, rlen, w = cft_batch([examples[i] for i in idx], pad, eos, B, *_weights(cfg), device)
        t, m = example_noise([(int(cfg["valid_noise_seed"]), i) for i in idx], rlen, cfg["complementary"],
                             cfg["t_eps"], device, B, float(cfg["suffix_fraction"]))
        loss = diffusion_loss(model, x, plen, rlen, B, mask_id, w, t=t, target_mask=m)
        total += float(loss) * float(rlen.sum())  # diffusion_loss averages over its C copies
        count += float(rlen.sum())
    total, count = D.all_reduce_sum([total, count], device)
    model.train(was)
    return total / max(count, 1.0)


@torch.no_grad()
def decode_eval(model, tok, examples, cands, n, tau, B, mask_id, ids, max_new, device, rank=0,
                world=1, commit_rule="confidence") -> dict:
    """Greedy τ-decode of the first n examples: valid-JSON rate, token accuracy vs the reference
    response, and tokens committed per block step."""
    was = model.training
    model.eval()
    eos, pad = ids
    mine = D.shard(list(range(min(n, len(examples)))), rank, world)
    flags, acc, toks, steps = [], [0.0, 0.0], 0, 0
    if mine:
        ex = [examples[i] for i in mine]
        refs = [e.input_ids[e.n_prompt:] for e in ex]
        limit = int(max_new or max(len(r) for r in refs) + B)
        res = diffusion_decode(model, [e.input_ids[:e.n_prompt] for e in ex], limit, B, mask_id, eos,
                               pad_token_id=pad, tau=tau, commit_rule=commit_rule)
        flags = valid_json(tok, res.tokens, [cands[i] for i in mine])
        for out, ref in zip(res.tokens, refs):
            acc[0] += sum(a == b for a, b in zip(out, ref))
            acc[1] += len(ref)
        toks = sum(len(t) for t in res.tokens)
        steps = sum(sum(s) for s in res.steps_per_block)
    known = [f for f in flags if f is not None]
    ok, nk, a0, a1, tk, st = D.all_reduce_sum([sum(known), len(known), *acc, toks, steps], device)
    model.train(was)
    return {"valid_json_rate": ok / nk if nk else None, "token_acc": a0 / max(a1, 1),
            "tokens_per_step": tk / max(st, 1)}


def _weights(cfg) -> tuple[float, float, float]:
    lo = float(cfg["lambda_o"])
    fill = lo if cfg["fill_weight"] is None else float(cfg["fill_weight"])
    return float(cfg["lambda_r"]), lo, fill


def check_config(cfg: dict) -> None:
    lam_r, lam_o, fill = _weights(cfg)
    if min(lam_r, lam_o, fill) < 0 or lam_r + lam_o == 0:
        raise ValueError(f"lambda_r, lambda_o, fill_weight must be >= 0 with λ_r + λ_o > 0, "
                         f"got {lam_r}, {lam_o}, {fill}")
    if not 0.0 <= float(cfg["suffix_fraction"]) <= 1.0:
        raise ValueError(f"suffix_fraction must be in [0, 1], got {cfg['suffix_fraction']}")
    if int(cfg["batch_size"]) < 1 or int(cfg["epochs"]) < 0:
        raise ValueError("batch_size must be >= 1 and epochs >= 0")
    check_autocast(cfg["autocast"])


def train_cft(ctx: StageContext) -> StageResult:
    cfg, device = setup(ctx, check_config)
    rank, world = ctx.rank, ctx.world_size
    notes = []  # messages from before the logger exists
    model, tok, B, mask_id = load_diffusion_model(ctx, cfg["block_size"], cfg["dtype"], notes.append)
    # The validation decode decodes as the model is served (its recorded tau and commit rule).
    served = served_rollout_settings({"tau": cfg["decode_tau"], "commit_rule": None}, model.config)
    model.train()
    ids = token_ids(tok)
    max_len = min(int(cfg["max_len"]), int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30))
    lam = _weights(cfg)

    data_dir = Path(ctx.data_dir) if ctx.data_dir is not None else Path(".")
    train, _, train_stats = load_split(tok, data_dir, cfg["train_file"], cfg["max_train_examples"], max_len)
    valid, valid_cands = [], []
    if cfg["valid_file"] and (data_dir / cfg["valid_file"]).is_file():
        valid, valid_cands, _ = load_split(tok, data_dir, cfg["valid_file"], cfg["max_valid_examples"], max_len)
    elif cfg["valid_file"]:
        notes.append(f"{ctx.name}: no {cfg['valid_file']} in the data dir: no validation, the last model is the output")

    plan = epoch_plan(cfg, len(train), world)
    opt, sched = optimizer_and_scheduler(model, cfg, warmup_steps_from(cfg, plan.total), plan.total)
    run = Run(ctx, model, tok, opt, sched, plan.total, notes=notes)
    state, log = run.state, run.log
    if not run.resumed:
        log.log(0, "data", {**train_stats, "valid_examples": len(valid), "world_size": world, "block_size": B,
                            "grad_accum": plan.grad_accum, "micro_batch_size": plan.micro_batch_size,
                            "total_steps": plan.total})

    def validate():
        if not valid:
            return
        val = {"loss": evaluate_loss(model, valid, cfg, ids, B, mask_id, device, rank, world)}
        if int(cfg["decode_examples"]) > 0:
            val.update(decode_eval(model, tok, valid, valid_cands, int(cfg["decode_examples"]), served["tau"], B,
                                   mask_id, ids, cfg["decode_max_new_tokens"], device, rank, world,
                                   served["commit_rule"]))
        run.record_validation(val, val["loss"])

    for batch in scheduled_batches(state, plan, ctx.seed, validate, run.snapshot):
        n_tokens = sum(padded_len(train[i], B) for i in batch)  # global N (fill included), known to every rank
        loss_sum = 0.0
        for a, idx in enumerate(D.rank_micro_batches(batch, rank, world, plan.grad_accum)):
            x, plen, rlen, w = cft_batch([train[i] for i in idx], ids[1], ids[0], B, *lam, device)
            t, m = example_noise([(ctx.seed, state.step, i) for i in idx], rlen, cfg["complementary"], cfg["t_eps"],
                                 device, B, float(cfg["suffix_fraction"]))  # keyed by (step, example): any world size
            with autocast(cfg["autocast"], device):
                loss = diffusion_loss(model, x, plen, rlen, B, mask_id, w, t=t, target_mask=m)
            part = loss * (float(rlen.sum()) / n_tokens)  # this micro-batch's share of the global mean
            part.backward()
            loss_sum += float(part.detach())
        D.sum_gradients(model)
        grad_norm, lr = optimizer_step(model, opt, sched, cfg["max_grad_norm"])
        state.step += 1
        state.batch_in_epoch += 1
        state.last_train_loss = last_loss = D.all_reduce_sum([loss_sum], device)[0]
        log.log(state.step, "train", {"loss": last_loss, "lr": lr, "grad_norm": grad_norm, "tokens": n_tokens,
                                      "epoch": state.epoch})
        log.progress(1, loss=last_loss, epoch=state.epoch)
        after_step(state, cfg, plan.total, validate, run.snapshot)

    return StageResult(optimizer_steps=state.step, metrics=run.finish(bool(valid), {
        **run.validation_summary(bool(valid), "loss", ("loss", "valid_json_rate", "token_acc", "tokens_per_step")),
        "block_size": B, "train_examples": len(train), "valid_examples": len(valid),
    }))


class CFTStage(Stage):
    name, defaults = "cft", DEFAULTS

    def run(self, ctx: StageContext) -> StageResult:
        return train_cft(ctx)
