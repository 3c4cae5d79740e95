"""SFT of the AR re-ranker on reasoning traces, with decoupled reasoning/answer loss weights.

    loss = ( λ_r · Σ_reasoning −log p(x_t | x_<t)  +  λ_o · Σ_answer −log p(x_t | x_<t) ) / N

where N is the number of supervised (response) tokens in the *global* batch and the prompt is
not supervised. GR2 uses λ_r < λ_o: the answer is what is scored, the trace is a means.

One optimizer step consumes one global batch of `batch_size` examples whatever the world size:
each rank runs `grad_accum` micro-batches of batch_size / world / grad_accum examples. Every
rank knows the whole global batch (the shuffled order is a function of seed and epoch), so it
divides its loss by the global N itself, and DDP's gradient averaging times world_size gives
exactly the 1-process gradient (see rank_micro_batches).

The stage output is the model with the lowest validation loss (validated at the end of every
epoch, and every `eval_every` steps if set).
"""
from __future__ import annotations

from pathlib import Path

import torch

from reranker.stages.base import Stage, StageContext, StageResult
from reranker.training import distributed as D
from reranker.training.batches import (IGNORE, collate, encode_examples, read_jsonl, read_train_records,
                                      weighted_nll)
from reranker.training.loop import after_step, epoch_plan, scheduled_batches
from reranker.training.precision import autocast, check_autocast
from reranker.training.recipe import Run, load_model_and_tokenizer, optimizer_and_scheduler, optimizer_step, setup
from reranker.training.schedule import warmup_steps_from

DEFAULTS = {
    # Relative to the data dir (or absolute). A list is a mix: the files' records are pooled and
    # shuffled together each epoch; list a file twice to weight it twice.
    "train_file": "train.jsonl",
    "valid_file": "valid.jsonl",  # null or missing file: no validation, the last model is the output
    "max_train_examples": None,
    "max_valid_examples": None,
    "max_len": 1024,  # prompt + response tokens; the prompt is cut from the left beyond it
    "epochs": 3,
    "max_steps": None,  # optional cap on optimizer steps
    "batch_size": 16,  # global: examples per optimizer step, the same on any world size
    "grad_accum": 1,
    "micro_batch_size": None,  # per rank; when set, grad_accum = batch_size / (world * micro)
    "eval_batch_size": 8,
    "lr": 1e-3,
    "min_lr_ratio": 0.1,
    "warmup_ratio": 0.05,
    "warmup_steps": None,  # overrides warmup_ratio
    "weight_decay": 0.01,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "max_grad_norm": 1.0,  # null or 0: no clipping
    "lambda_r": 0.5,  # weight of reasoning tokens
    "lambda_o": 1.0,  # weight of answer tokens (from </think> on, and the end-of-turn token)
    "allow_lambda_r_above_lambda_o": False,
    "dtype": "float32",
    "autocast": "none",  # "bf16": bfloat16 matmuls in the training forward, fp32 weights (training/precision.py)
    "save_every": 50,  # optimizer steps between checkpoints (plus one after every validation)
    "keep_checkpoints": 2,
    "eval_every": None,  # extra validations every N steps (besides each epoch end)
    "resume": True,
}


def check_config(cfg: dict) -> None:
    lr_, lo = float(cfg["lambda_r"]), float(cfg["lambda_o"])
    if lr_ < 0 or lo < 0 or lr_ + lo == 0:
        raise ValueError(f"lambda_r and lambda_o must be >= 0 and not both 0, got {lr_}, {lo}")
    if lr_ > lo and not cfg["allow_lambda_r_above_lambda_o"]:
        raise ValueError(f"lambda_r ({lr_}) > lambda_o ({lo}): GR2 weights the answer at least as much as the "
                         "reasoning; set allow_lambda_r_above_lambda_o: true to do this on purpose")
    if int(cfg["batch_size"]) < 1 or int(cfg["epochs"]) < 0:
        raise ValueError("batch_size must be >= 1 and epochs >= 0")
    check_autocast(cfg["autocast"])


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _forward(model, b: dict) -> tuple[torch.Tensor, int]:
    """(logits, start): the logits of batch `b` from column `start` on, the first column that
    predicts a supervised token. The prompt's logits carry no loss, and at ~350 prompt tokens of
    ~530 their projection onto the vocabulary was ~45% of a small model's training step
    (docs/EXPERIMENTS.md).

    No attention mask: collate pads on the right, so under causal attention no real token ever
    sees a pad (pads only follow it), and the pads' own outputs carry no loss. The unmasked path
    is the fused causal kernel, ~1.5x faster per step on CPU than an explicit padding mask."""
    supervised = (b["labels"] != IGNORE).any(dim=0).nonzero()
    start = max(int(supervised[0]) - 1, 0) if len(supervised) else 0
    logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False,
                   logits_to_keep=b["input_ids"].shape[1] - start).logits
    return logits, start


def _nll(logits: torch.Tensor, start: int, b: dict) -> tuple[torch.Tensor, dict]:
    return weighted_nll(logits, b["labels"][:, start:], b["loss_weights"][:, start:], b["answer_mask"][:, start:])


@torch.no_grad()
def evaluate(model, examples, pad_id: int, lambda_r: float, lambda_o: float, batch_size: int,
             device, rank: int = 0, world_size: int = 1) -> dict:
    """Weighted loss (the training objective), per-token NLL and answer-only NLL over the whole
    set; each rank scores a strided shard and the sums are all-reduced."""
    was_training = model.training
    model.eval()
    mine = D.shard(list(range(len(examples))), rank, world_size)
    mine.sort(key=lambda i: len(examples[i].input_ids))  # less padding; sums do not depend on order
    sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # weighted, tokens, nll, answer nll, answer tokens
    for s in range(0, len(mine), batch_size):
        b = _to(collate([examples[i] for i in mine[s:s + batch_size]], pad_id, lambda_r, lambda_o), device)
        loss_sum, st = _nll(*_forward(model, b), b)
        parts = [float(loss_sum), st["tokens"], st["nll_sum"], st["answer_nll_sum"], st["answer_tokens"]]
        sums = [x + y for x, y in zip(sums, parts)]
    w, n, nll, anll, an = D.all_reduce_sum(sums, device)
    model.train(was_training)
    return {"loss": w / max(n, 1), "nll": nll / max(n, 1), "answer_nll": anll / max(an, 1), "tokens": n}


def train_sft(ctx: StageContext) -> StageResult:
    cfg, device = setup(ctx, check_config)
    rank, world = ctx.rank, ctx.world_size
    model, tok = load_model_and_tokenizer(ctx.input_dir, cfg["dtype"], device)
    model.train()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    max_len = int(cfg["max_len"])
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos:
        max_len = min(max_len, int(max_pos))
    lam_r, lam_o = float(cfg["lambda_r"]), float(cfg["lambda_o"])

    data_dir = Path(ctx.data_dir) if ctx.data_dir is not None else Path(".")
    train_records = read_train_records(data_dir, cfg["train_file"], cfg["max_train_examples"])
    train, train_stats = encode_examples(tok, train_records, max_len)
    valid = []
    if cfg["valid_file"] and (data_dir / cfg["valid_file"]).is_file():
        valid, _ = encode_examples(tok, read_jsonl(data_dir / cfg["valid_file"], cfg["max_valid_examples"]), max_len)
    elif cfg["valid_file"] and ctx.is_main:
        print(f"{ctx.name}: no {cfg['valid_file']} in the data dir: no validation, the last model is the output",
              flush=True)

    plan = epoch_plan(cfg, len(train), world)
    opt, sched = optimizer_and_scheduler(model, cfg, warmup_steps_from(cfg, plan.total), plan.total)
    run = Run(ctx, model, tok, opt, sched, plan.total)
    state, log = run.state, run.log
    if not run.resumed:
        log.log(0, "data", {**train_stats, "valid_examples": len(valid), "world_size": world,
                            "grad_accum": plan.grad_accum, "micro_batch_size": plan.micro_batch_size,
                            "total_steps": plan.total})
        if train_stats["prompt_truncated_examples"] or train_stats["response_truncated_examples"]:
            log.message(f"{ctx.name}: truncated to max_len={max_len}: "
                        f"{train_stats['prompt_truncated_examples']} prompts (from the left), "
                        f"{train_stats['response_truncated_examples']} responses of {len(train)}")
    env = D.init_distributed("cuda" if device.type == "cuda" else "cpu")  # joined already by the runner
    if env.world_size != world:
        raise RuntimeError(f"context says world_size {world}, the process group has {env.world_size}")
    ddp = D.wrap_ddp(model, env)

    def validate():
        if valid:
            val = evaluate(model, valid, pad_id, lam_r, lam_o, int(cfg["eval_batch_size"]), device, rank, world)
            run.record_validation({k: val[k] for k in ("loss", "nll", "answer_nll")}, val["loss"])

    for batch in scheduled_batches(state, plan, ctx.seed, validate, run.snapshot):
        n_tokens = sum(train[i].n_supervised for i in batch)  # global N, known to every rank
        sums = [0.0, 0.0, 0.0, 0.0]  # weighted, nll, answer nll, answer tokens
        micro_batches = D.rank_micro_batches(batch, rank, world, plan.grad_accum)
        for a, idx in enumerate(micro_batches):
            b = _to(collate([train[i] for i in idx], pad_id, lam_r, lam_o), device)
            with D.no_sync(ddp, a < len(micro_batches) - 1):
                with autocast(cfg["autocast"], device):
                    logits, start = _forward(ddp, b)
                loss_sum, st = _nll(logits, start, b)
                # DDP averages gradients over ranks; × world turns that average into the sum.
                (loss_sum * (world / max(n_tokens, 1))).backward()
            parts = [float(loss_sum.detach()), st["nll_sum"], st["answer_nll_sum"], st["answer_tokens"]]
            sums = [x + y for x, y in zip(sums, parts)]
        grad_norm, lr = optimizer_step(model, opt, sched, cfg["max_grad_norm"])
        state.step += 1
        state.batch_in_epoch += 1

        w, nll, anll, an = D.all_reduce_sum(sums, device)
        state.last_train_loss = last_loss = w / max(n_tokens, 1)
        log.log(state.step, "train", {"loss": last_loss, "nll": nll / max(n_tokens, 1), "answer_nll": anll / max(an, 1),
                                      "lr": lr, "grad_norm": grad_norm, "tokens": n_tokens, "epoch": state.epoch})
        log.progress(1, loss=last_loss, epoch=state.epoch)
        after_step(state, cfg, plan.total, validate, run.snapshot)

    return StageResult(optimizer_steps=state.step, metrics=run.finish(bool(valid), {
        **run.validation_summary(bool(valid), "loss", ("loss", "nll", "answer_nll")),
        "train_examples": len(train),
        "valid_examples": len(valid),
        "prompt_truncated_examples": train_stats["prompt_truncated_examples"],
    }))


class SFTStage(Stage):
    name, defaults = "sft", DEFAULTS

    def run(self, ctx: StageContext) -> StageResult:
        return train_sft(ctx)
