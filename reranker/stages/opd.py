"""OPD: on-policy distillation of the block-diffusion student from its frozen AR teacher.

One optimizer step, per prompt of the global batch:
  1. rollout  the student samples G' = 4 trajectories with its real decoder (diffusion_decode at the
              serving τ and block size, temperature 1.0), recording each token's commit step;
  2. teacher  the AR teacher scores exactly those tokens in ONE teacher-forced pass over prompt +
              response (AR shift: the logit at column t-1 predicts token t); its distribution at each
              position is cached (top-k logits + log-sum-exp, reranker.rl.distill, k = 64; k = 0: full);
  3. student  replay_logits re-scores each committed token on the canvas it was committed from,
              with gradients;
  4. loss     forward KL(teacher || student) averaged over the kept positions of the global batch
              (reverse KL or generalized JSD(β) as options).

Steps 3-4 run REPLAY_ROWS rollouts at a time, each slice's share of the loss back-propagated before
the next is replayed. The loss is a sum over positions, so the gradient is the same; only the
memory changes: one replay attends over the prompt, the response and every noisy window of its
rows, and its saved attention grows with the square of that length, so a rollout that took many
steps makes the whole pass large (32 rollouts in one replay went past 24 GB on Beauty).

Tokens committed AFTER the first EOS (possible inside the last block, in the same or an earlier
step than the EOS) are not part of the output and get no loss: the AR teacher was never trained
past its end-of-turn token, so its distribution there is meaningless, and CFT's EOS fill already
taught the student to put EOS there. They still sit on the canvas that later kept commits saw,
and replay reproduces that canvas exactly, so the kept positions are scored correctly.

The student stays in eval mode (no dropout) so that the replayed distribution is the one that
sampled the rollout. The student's distribution in the loss is softmax(logits) (T = 1), whatever
the sampling temperature. Rollout noise is keyed by (seed, step, micro-batch): resuming redoes the
very same rollouts. Each rank samples its own prompts (its micro-batches of the global batch);
gradients are summed over ranks as in cft (training.distributed.sum_gradients).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reranker.diffusion import DiffusionResult, diffusion_decode, replay_logits
from reranker.decoding import served_rollout_settings
from reranker.diffusion.forward import check_commit_rule, forward
from reranker.diffusion.masks import block_causal_mask, pack_prompt_response, position_ids_for
from reranker.rl.distill import DIVERGENCES, TeacherLogits, cache_teacher, divergence
from reranker.stages.base import Stage, StageContext, StageResult
from reranker.training import distributed as D
from reranker.training.batches import token_ids
from reranker.training.candidates import load_split, valid_json
from reranker.training.loop import after_step, epoch_plan, scheduled_batches
from reranker.training.precision import autocast, check_autocast
from reranker.training.recipe import (Run, load_diffusion_model, load_model_and_tokenizer, optimizer_and_scheduler,
                                      optimizer_step, setup)
from reranker.training.schedule import warmup_steps_from

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
    "tau": None,  # rollout confidence threshold; None: the student's recorded one (reranker.decoding)
    "block_size": None,  # None: the student's config.diffusion.block_size
    "temperature": 1.0,
    "max_new_tokens": 256,
    "max_steps_per_block": None,
    "commit_rule": None,  # the decoder's commit rule; None: the student's recorded one, as served
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
    if not path:
        raise ValueError("opd: config key 'teacher' (the frozen AR teacher's model directory) is required")
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"opd: teacher model directory not found: {path}")
    teacher, tok = load_model_and_tokenizer(path, dtype, device)
    sv = student_tok.get_vocab()
    bad = [t for t, i in tok.get_vocab().items() if sv.get(t) != i]
    if bad:
        raise ValueError(f"opd: teacher and student tokenizers differ ({len(bad)} tokens, e.g. {bad[0]!r})")
    return teacher.eval().requires_grad_(False)


# Rollouts per replayed forward/backward pass (memory only: the summed loss and its gradient are
# those of one pass over all rows, up to float round-off).
REPLAY_ROWS = 8


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

    def row_slices(self, rows: int = REPLAY_ROWS):
        """(prompts, trajectories, teacher cache) of consecutive slices of `rows` rollouts: the cache
        is row-major over each rollout's kept positions, so a slice's part is contiguous."""
        trajs, start = self.result.trajectories, 0
        for a in range(0, len(trajs), rows):
            n = sum(t.length for t in trajs[a:a + rows])
            yield self.prompts[a:a + rows], trajs[a:a + rows], self.cache.rows(start, start + n)
            start += n


def make_rollouts(student, teacher, tok, prompts, cands, cfg, B, mask_id, ids, temperature, generator) -> Rollouts:
    eos, pad = ids
    res = diffusion_decode(student, prompts, int(cfg["max_new_tokens"]), B, mask_id, eos, pad_token_id=pad,
                           tau=float(cfg["tau"]), temperature=temperature,
                           max_steps_per_block=cfg["max_steps_per_block"], generator=generator,
                           commit_rule=cfg["commit_rule"])
    cache, tlp = teacher_scores(teacher, prompts, kept_responses(res.trajectories), pad, int(cfg["top_k"]))
    return Rollouts(prompts, res, cache, tlp, valid_json(tok, res.tokens, cands))


def replayed_loss(student, r: Rollouts, B, mask_id, pad_id, kind, beta, max_windows, precision, scale=None,
                  rows=REPLAY_ROWS):
    """The summed divergence over r's kept positions, replayed `rows` rollouts at a time; with
    `scale`, each slice's loss * scale is back-propagated as soon as it is computed (so only one
    slice's graph is alive). Returns the sum as a float."""
    total = 0.0
    for prompts, trajs, cache in r.row_slices(rows):
        with autocast(precision, student.device):
            loss, _ = opd_loss_sum(student, cache, prompts, trajs, B, mask_id, pad_id, kind, beta, max_windows)
        if scale is not None:
            (loss * scale).backward()
        total += float(loss.detach())
    return total


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
    if cfg["commit_rule"] is not None:
        check_commit_rule(cfg["commit_rule"], "opd: commit_rule")


def train_opd(ctx: StageContext) -> StageResult:
    cfg, device = setup(ctx, check_config)
    rank, world = ctx.rank, ctx.world_size
    notes = []
    model, tok, B, mask_id = load_diffusion_model(ctx, cfg["block_size"], cfg["dtype"], notes.append)
    cfg.update(served_rollout_settings(cfg, model.config))
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

    plan = epoch_plan(cfg, len(train), world, "training prompts")
    accum = plan.grad_accum
    opt, sched = optimizer_and_scheduler(model, cfg, warmup_steps_from(cfg, plan.total), plan.total)
    run = Run(ctx, model, tok, opt, sched, plan.total, notes=notes)
    state, log = run.state, run.log
    if not run.resumed:
        log.log(0, "data", {"train_prompts": len(train), "valid_prompts": len(valid), "world_size": world,
                            "block_size": B, "group_size": Gp, "top_k": int(cfg["top_k"]), "total_steps": plan.total})

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
            loss_sum = replayed_loss(model, r, B, mask_id, ids[1], kind, beta, cfg["replay_max_windows"],
                                     cfg["autocast"])
            sums = r.stats()
        *sums, loss_sum = D.all_reduce_sum([*sums, loss_sum], device)
        val = summarize(sums, loss_sum)
        run.record_validation(val, val["kl"])

    for batch in scheduled_batches(state, plan, ctx.seed, validate, run.snapshot):
        # 1-2. This rank's rollouts and their teacher caches (no graph is kept).
        rolls = []
        for a, idx in enumerate(D.rank_micro_batches(batch, rank, world, accum)):
            gen = D.seeded(device, ctx.seed, state.step, rank * accum + a)
            rolls.append(make_rollouts(model, teacher, tok, [prompt(train[i]) for i in idx for _ in range(Gp)],
                                       [train_cands[i] for i in idx for _ in range(Gp)], cfg, B, mask_id, ids,
                                       float(cfg["temperature"]), gen))
        # The mean is over the kept tokens of the GLOBAL batch, only known once every rank has sampled.
        sums = D.all_reduce_sum([sum(col) for col in zip(*(r.stats() for r in rolls))], device)
        n_global = max(sums[0], 1.0)
        # 3-4. Replay each micro-batch with gradients; its share of the global mean.
        loss_sum = sum(replayed_loss(model, r, B, mask_id, ids[1], kind, beta, cfg["replay_max_windows"],
                                     cfg["autocast"], scale=1.0 / n_global) for r in rolls)
        D.sum_gradients(model)
        grad_norm, lr = optimizer_step(model, opt, sched, cfg["max_grad_norm"])
        state.step += 1
        state.batch_in_epoch += 1
        (loss_sum,) = D.all_reduce_sum([loss_sum], device)
        metrics = summarize(sums, loss_sum)
        state.last_train_loss = metrics["kl"]
        log.log(state.step, "train", {**metrics, "lr": lr, "grad_norm": grad_norm, "epoch": state.epoch})
        log.progress(1, kl=metrics["kl"], epoch=state.epoch)
        after_step(state, cfg, plan.total, validate, run.snapshot)

    return StageResult(optimizer_steps=state.step, metrics=run.finish(bool(valid), {
        **run.validation_summary(bool(valid), "kl", ("kl", "valid_json_rate", "tokens_per_step")),
        "divergence": kind, "block_size": B, "train_prompts": len(train),
    }))


class OPDStage(Stage):
    name, defaults = "opd", DEFAULTS

    def run(self, ctx: StageContext) -> StageResult:
        return train_opd(ctx)
