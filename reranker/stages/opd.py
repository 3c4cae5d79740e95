"""OPD: on-policy distillation of the block-diffusion student from its frozen AR teacher.

One optimizer step, per prompt of the global batch:
  1. rollout  the student samples G' = 4 trajectories with its real decoder (diffusion_decode at the
              serving τ and block size, temperature 1.0), recording each token's commit step;
  2. teacher  the AR teacher scores exactly those tokens in ONE teacher-forced pass over prompt +
              response (AR shift: the logit at column t-1 predicts token t); its distribution at each
              position is cached (top-k logits + log-sum-exp, reranker.distill, k = 64; k = 0: full);
  3. student  replay_logits re-scores each committed token on the canvas it was committed from,
              with gradients;
  4. loss     forward KL(teacher || student) averaged over the kept positions of the global batch
              (reverse KL or generalized JSD(β) as options).

Tokens committed AFTER the first EOS (possible inside the last block, in the same or an earlier
step than the EOS) are not part of the output and get no loss: the AR teacher was never trained
past its end-of-turn token, so its distribution there is meaningless, and CFT's EOS fill already
taught the student to put EOS there. They still sit on the canvas that later kept commits saw,
and replay reproduces that canvas exactly, so the kept positions are scored correctly.

The student stays in eval mode (no dropout) so that the replayed distribution is the one that
sampled the rollout. The student's distribution in the loss is softmax(logits) (T = 1), whatever
the sampling temperature. Rollout noise is keyed by (seed, step, micro-batch): resuming redoes the
very same rollouts. Each rank samples its own prompts (its micro-batches of the global batch);
gradients are summed over ranks as in cft.
"""
from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from reranker.decoding import DiffusionResult, diffusion_decode, replay_logits
from reranker.decoding.forward import check_commit_rule, forward
from reranker.distill import DIVERGENCES, TeacherLogits, cache_teacher, divergence
from reranker.masks import block_causal_mask, pack_prompt_response, position_ids_for
from reranker.stages.base import Stage, StageContext, StageResult
from reranker.stages.cft import (load_diffusion_model, load_split, seeded, sum_gradients, token_ids,
                                 valid_json)
from reranker.stages.sft import accumulation
from reranker.training import distributed as D
from reranker.training.checkpoint import (Checkpointer, TrainState, capture_rng, restore,
                                          save_hf_dir)
from reranker.training.logging import RunLogger
from reranker.training.precision import autocast, check_autocast
from reranker.training.loop import after_step, finish, scheduled_batches
from reranker.training.schedule import build_optimizer, build_scheduler, warmup_steps_from

DEFAULTS = {
    "teacher": None,  # required: the frozen AR teacher's model dir
    "train_file": "train.jsonl",  # prompts (the assistant text is not used)
    "valid_file": "valid.jsonl",
    "max_train_examples": None,
    "max_valid_examples": None,
    "max_len": 1024,  # prompt tokens are cut from the left beyond max_len - max_new_tokens
    "epochs": 1,
    "max_steps": None,
    "batch_size": 8,  # global prompts per optimizer step (x group_size rollouts)
    "grad_accum": 1,
    "micro_batch_size": None,
    "group_size": 4,  # G': rollouts per prompt
    "tau": 0.9,  # serving confidence threshold
    "block_size": None,  # None: the student's config.diffusion.block_size
    "temperature": 1.0,
    "max_new_tokens": 256,
    "max_steps_per_block": None,
    "commit_rule": "confidence",  # the decoder's commit rule, as served (forward.commit_confident)
    "divergence": "forward_kl",  # forward_kl | reverse_kl | jsd
    "jsd_beta": 0.5,
    "top_k": 64,  # teacher cache: top-k logits + log-sum-exp; 0 = full logits
    "replay_max_windows": None,  # bound on noisy windows per replay forward (memory)
    "eval_examples": 16,  # greedy rollouts of this many validation prompts per validation; 0: off
    "lr": 1e-4,
    "min_lr_ratio": 0.1,
    "warmup_ratio": 0.05,
    "warmup_steps": None,
    "weight_decay": 0.0,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "max_grad_norm": 1.0,
    "dtype": "float32",
    "autocast": "none",  # "bf16": bfloat16 matmuls in the replayed (trained) forward (training/precision.py)
    "save_every": 20,
    "keep_checkpoints": 2,
    "eval_every": None,
    "resume": True,
}


# ---------------------------------------------------------------------------- components

def kept_responses(trajectories) -> list[list[int]]:
    """The output tokens of each rollout (through the first EOS): what the loss is over."""
    return [t.tokens[:t.length].tolist() for t in trajectories]


@torch.no_grad()
def teacher_scores(teacher, prompts, responses, pad_id, top_k=64) -> tuple[TeacherLogits, torch.Tensor]:
    """One causal teacher-forced pass over prompt + response; returns the cache of the teacher's
    distribution for every response token (row-major: row, then position) and each token's
    teacher log-prob (for logging)."""
    dev = teacher.device
    ids, plen, rlen = pack_prompt_response(prompts, responses, pad_id)
    ids, plen, rlen = ids.to(dev), plen.to(dev), rlen.to(dev)
    P, L = int(plen.max()), int(rlen.max())
    x = ids[:, :P + L - 1]  # the last response token predicts nothing
    col = torch.arange(x.shape[1], device=dev)
    valid = col[None] >= (P - plen)[:, None]  # right padding is only ever seen by pad queries
    grp = torch.zeros_like(col)
    mask = block_causal_mask(col, grp, col, grp, valid)  # one-token blocks = causal
    logits = forward(teacher, x, position_ids_for(plen, P, x.shape[1]), mask, logits_to_keep=L)  # (b, L, V)
    kept = torch.arange(L, device=dev)[None] < rlen[:, None]
    flat, target = logits[kept], ids[:, P:][kept]
    return cache_teacher(flat, top_k), torch.log_softmax(flat, -1).gather(-1, target[:, None]).squeeze(-1)


def student_logits(student, prompts, trajectories, block_size, mask_id, pad_id, max_windows=None):
    """Replayed student logits (N, V) at every kept position (same row-major order as teacher_scores)."""
    logits, committed = replay_logits(student, prompts, trajectories, block_size, mask_id, pad_id, max_windows)
    kept = torch.zeros_like(committed)
    for r, t in enumerate(trajectories):
        kept[r, :t.length] = True
    if not bool(committed[kept].all()):
        raise RuntimeError("a kept position was never committed: trajectory and decoder disagree")
    return logits[kept]


def opd_loss_sum(student, teacher_cache, prompts, trajectories, block_size, mask_id, pad_id, kind="forward_kl",
                 beta=0.5, max_windows=None) -> tuple[torch.Tensor, int]:
    """(sum of the per-position divergence over kept positions, their number); differentiable in
    the student only."""
    s = student_logits(student, prompts, trajectories, block_size, mask_id, pad_id, max_windows)
    d = divergence(s, teacher_cache, kind, beta)
    return d.sum(), d.numel()


def load_teacher(path, student_tok, dtype, device):
    """The frozen teacher; its vocabulary must be the student's (up to added tokens such as the mask)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path:
        raise ValueError("opd: config key 'teacher' (the frozen AR teacher's model directory) is required")
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"opd: teacher model directory not found: {path}")
    tok = AutoTokenizer.from_pretrained(str(path))
    sv = student_tok.get_vocab()
    bad = [t for t, i in tok.get_vocab().items() if sv.get(t) != i]
    if bad:
        raise ValueError(f"opd: teacher and student tokenizers differ ({len(bad)} tokens, e.g. {bad[0]!r})")
    teacher = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), local_files_only=True)
    teacher.to(device).eval().requires_grad_(False)
    return teacher


@dataclass
class Rollouts:
    """One micro-batch of rollouts with the teacher's cache: all that the backward pass needs."""
    prompts: list             # token ids per rollout (each prompt repeated G' times)
    result: DiffusionResult   # tokens, trajectories, steps per block
    cache: TeacherLogits      # teacher distribution at every kept position (row-major)
    teacher_lp: torch.Tensor  # teacher log-prob of each kept token (logging)
    flags: list               # valid-JSON per rollout: True / False / None (no candidates known)

    @property
    def n_tokens(self) -> int:
        return len(self.cache)

    def stats(self) -> list[float]:
        """[kept tokens, block steps, teacher log-prob sum, valid-JSON ok, valid-JSON known]."""
        steps = sum(sum(s) for s in self.result.steps_per_block)
        known = [f for f in self.flags if f is not None]
        # kept tokens per block step: post-EOS commits are not output, so they do not count
        return [self.n_tokens, steps, float(self.teacher_lp.sum()), sum(known), len(known)]


def make_rollouts(student, teacher, tok, prompts, cands, cfg, B, mask_id, ids, temperature, generator) -> Rollouts:
    eos, pad = ids
    res = diffusion_decode(student, prompts, int(cfg["max_new_tokens"]), B, mask_id, eos, pad_token_id=pad,
                           tau=float(cfg["tau"]), temperature=temperature,
                           max_steps_per_block=cfg["max_steps_per_block"], generator=generator,
                           commit_rule=cfg["commit_rule"])
    cache, tlp = teacher_scores(teacher, prompts, kept_responses(res.trajectories), pad, int(cfg["top_k"]))
    return Rollouts(prompts, res, cache, tlp, valid_json(tok, res.tokens, cands))


def summarize(sums, loss_sum) -> dict:
    """Global metrics from all-reduced [kept tokens, steps, teacher lp, ok, known] and the loss sum."""
    n, steps, tlp, ok, known = sums
    return {"kl": loss_sum / max(n, 1), "teacher_nll": -tlp / max(n, 1), "tokens_per_step": n / max(steps, 1),
            "valid_json_rate": ok / known if known else None, "tokens": n}


def check_config(cfg: dict) -> None:
    if cfg["divergence"] not in DIVERGENCES:
        raise ValueError(f"opd: divergence must be one of {', '.join(DIVERGENCES)}, got {cfg['divergence']!r}")
    if int(cfg["group_size"]) < 1 or int(cfg["batch_size"]) < 1 or int(cfg["max_new_tokens"]) < 1:
        raise ValueError("opd: group_size, batch_size and max_new_tokens must be >= 1")
    if int(cfg["top_k"]) < 0:
        raise ValueError(f"opd: top_k must be >= 0 (0 = full logits), got {cfg['top_k']}")
    check_autocast(cfg["autocast"])
    check_commit_rule(cfg["commit_rule"], "opd: commit_rule")


def train_opd(ctx: StageContext) -> StageResult:
    cfg = ctx.config
    check_config(cfg)
    device = torch.device(ctx.device)
    rank, world = ctx.rank, ctx.world_size
    torch.manual_seed(ctx.seed * 1000 + rank)
    notes = []
    model, tok, B, mask_id = load_diffusion_model(ctx, ctx.input_dir, cfg["block_size"], cfg["dtype"], notes.append)
    model.eval()  # no dropout: the replayed policy is the one that sampled (gradients still flow)
    teacher = load_teacher(cfg["teacher"], tok, cfg["dtype"], device)
    ids = token_ids(tok)
    kind, beta, Gp = cfg["divergence"], float(cfg["jsd_beta"]), int(cfg["group_size"])

    data_dir = Path(ctx.data_dir) if ctx.data_dir is not None else Path(".")
    max_len = int(cfg["max_len"])
    train, train_cands, _ = load_split(tok, data_dir, cfg["train_file"], cfg["max_train_examples"], max_len)
    valid, valid_cands = [], []
    if cfg["valid_file"] and (data_dir / cfg["valid_file"]).is_file() and int(cfg["eval_examples"]) > 0:
        valid, valid_cands, _ = load_split(tok, data_dir, cfg["valid_file"], cfg["max_valid_examples"], max_len)
        valid, valid_cands = valid[:int(cfg["eval_examples"])], valid_cands[:int(cfg["eval_examples"])]
    keep_prompt = max(1, max_len - int(cfg["max_new_tokens"]))

    def prompt(e):  # the newest history and the candidates sit at the prompt's end: cut from the left
        return e.input_ids[:e.n_prompt][-keep_prompt:]

    G = int(cfg["batch_size"])
    accum, micro = accumulation(cfg, world)
    steps_per_epoch = len(train) // G
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train)} training prompts, fewer than one global batch of {G}")
    total = int(cfg["epochs"]) * steps_per_epoch
    if cfg["max_steps"] is not None:
        total = min(total, int(cfg["max_steps"]))

    opt = build_optimizer(model, float(cfg["lr"]), float(cfg["weight_decay"]), cfg["betas"], float(cfg["eps"]))
    sched = build_scheduler(opt, warmup_steps_from(cfg, total), max(total, 1), float(cfg["min_lr_ratio"]))
    ckpt = Checkpointer(Path(ctx.run_dir) / "checkpoints", (ctx.config_hash or "0")[:16], int(cfg["keep_checkpoints"]))
    state = TrainState()
    loaded = ckpt.load_latest() if cfg["resume"] else None
    if loaded is not None:
        state = restore(loaded, model, opt, sched, rank, world)
        del loaded
    elif ctx.is_main and Path(ctx.output_dir).exists():
        for p in Path(ctx.output_dir).iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    D.barrier()

    log = RunLogger(ctx.run_dir, enabled=ctx.is_main, progress=ctx.progress and ctx.is_main, total=total,
                    initial=state.step, desc=ctx.name, resume_step=state.step, resume_rows=state.metrics_rows)
    for line in notes:
        log.message(line)
    if state.step > 0:
        log.message(f"{ctx.name}: resuming at step {state.step}/{total} (epoch {state.epoch})")
    else:
        log.log(0, "data", {"train_prompts": len(train), "valid_prompts": len(valid), "world_size": world,
                            "block_size": B, "group_size": Gp, "top_k": int(cfg["top_k"]), "total_steps": total})
    started, seconds_before, resumed_from = time.perf_counter(), state.train_seconds, state.step

    def snapshot():
        state.train_seconds = seconds_before + time.perf_counter() - started
        state.metrics_rows = log.rows_written
        rngs = D.all_gather_object(capture_rng())
        if ctx.is_main:
            ckpt.save(state, model, opt, sched, rngs)
        D.barrier()

    @torch.no_grad()
    def validate():
        """Greedy serving-time rollouts of the validation prompts: teacher KL, valid-JSON rate."""
        if not valid:
            return
        mine = D.shard(list(range(len(valid))), rank, world)
        sums, loss_sum = [0.0] * 5, 0.0
        if mine:
            r = make_rollouts(model, teacher, tok, [prompt(valid[i]) for i in mine], [valid_cands[i] for i in mine],
                              cfg, B, mask_id, ids, 0.0, None)
            with autocast(cfg["autocast"], device):
                loss, _ = opd_loss_sum(model, r.cache, r.prompts, r.result.trajectories, B, mask_id, ids[1], kind,
                                       beta, cfg["replay_max_windows"])
            sums, loss_sum = r.stats(), float(loss)
        *sums, loss_sum = D.all_reduce_sum([*sums, loss_sum], device)
        val = summarize(sums, loss_sum)
        state.last_val = val
        log.log(state.step, "valid", val)
        if val["kl"] < state.best_val:
            state.best_val, state.best_step = val["kl"], state.step
            if ctx.is_main:
                save_hf_dir(model, tok, ctx.output_dir)
        D.barrier()

    def at_epoch_end():  # end of an epoch (or of training): validate once, checkpoint
        validate()
        snapshot()

    for batch in scheduled_batches(state, len(train), G, ctx.seed, steps_per_epoch, total, at_epoch_end):
        # 1-2. This rank's rollouts and their teacher caches (no graph is kept).
        rolls = []
        for a, idx in enumerate(D.rank_micro_batches(batch, rank, world, accum)):
            gen = seeded(device, ctx.seed, state.step, rank * accum + a)
            rolls.append(make_rollouts(model, teacher, tok, [prompt(train[i]) for i in idx for _ in range(Gp)],
                                       [train_cands[i] for i in idx for _ in range(Gp)], cfg, B, mask_id, ids,
                                       float(cfg["temperature"]), gen))
        # The mean is over the kept tokens of the GLOBAL batch, only known once every rank has sampled.
        sums = D.all_reduce_sum([sum(col) for col in zip(*(r.stats() for r in rolls))], device)
        n_global = max(sums[0], 1.0)
        # 3-4. Replay each micro-batch with gradients; its share of the global mean.
        loss_sum = 0.0
        for r in rolls:
            with autocast(cfg["autocast"], device):
                loss, _ = opd_loss_sum(model, r.cache, r.prompts, r.result.trajectories, B, mask_id, ids[1], kind,
                                       beta, cfg["replay_max_windows"])
            (loss / n_global).backward()
            loss_sum += float(loss.detach())
        sum_gradients(model)
        grad_norm = (float(torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg["max_grad_norm"])))
                     if cfg["max_grad_norm"] else math.nan)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        state.step += 1
        state.batch_in_epoch += 1
        (loss_sum,) = D.all_reduce_sum([loss_sum], device)
        metrics = summarize(sums, loss_sum)
        state.last_train_loss = metrics["kl"]
        log.log(state.step, "train", {**metrics, "lr": lr, "grad_norm": grad_norm, "epoch": state.epoch})
        log.progress(1, kl=metrics["kl"], epoch=state.epoch)
        after_step(state, cfg, total, validate, snapshot)

    finish(ctx, model, tok, bool(valid), log)
    lv = state.last_val
    metrics = {
        "best_val_kl": state.best_val if valid else None,
        "best_step": state.best_step if valid else state.step,
        "last_val_kl": lv.get("kl"),
        "last_val_valid_json_rate": lv.get("valid_json_rate"),
        "last_val_tokens_per_step": lv.get("tokens_per_step"),
        "last_train_kl": state.last_train_loss,
        "divergence": kind,
        "block_size": B,
        "train_prompts": len(train),
        "train_seconds": seconds_before + time.perf_counter() - started,
        "world_size": world,
        "resumed_from_step": resumed_from,
    }
    return StageResult(metrics=metrics, optimizer_steps=state.step)


class OPDStage(Stage):
    name = "opd"

    def default_config(self) -> dict:
        return dict(DEFAULTS)

    def run(self, ctx: StageContext) -> StageResult:
        return train_opd(ctx)
