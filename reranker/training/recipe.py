"""The skeleton every training stage's recipe is built from: what is the same in all of them, once.

Each stage still writes its own loop, top to bottom, with its own math (as torchtune recipes do);
only the parts around the loop live here:

    cfg, device = setup(ctx, check_config)
    model, tok = load_model_and_tokenizer(ctx.input_dir, cfg["dtype"], device)   # or load_diffusion_model
    opt, sched = optimizer_and_scheduler(model, cfg, warmup, total)
    run = Run(ctx, model, tok, opt, sched, total)   # resume from the newest checkpoint, or start clean
    for ...:                                        # the stage's loop
        ... backward ...
        grad_norm, lr = optimizer_step(model, opt, sched, cfg["max_grad_norm"])
        ... run.snapshot() / run.record_validation(val, loss) ...
    return StageResult(run.finish(has_valid, metrics), state.step)

A stage's config must carry `keep_checkpoints` and `resume` (every built-in stage declares them).
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

from reranker.text.tokenizer import load_tokenizer

from . import distributed as D
from .checkpoint import Checkpointer, TrainState, capture_rng, restore, save_hf_dir
from .logging import RunLogger
from .schedule import build_optimizer, build_scheduler


# ---------------------------------------------------------------------------- setup

def setup(ctx, check_config) -> tuple[dict, torch.device]:
    """(config, device): the stage's config checked before anything is loaded, and this rank's
    global RNG seeded: distinct per-rank streams for anything stochastic in the model (dropout);
    data order and noise never touch the global RNG."""
    check_config(ctx.config)
    torch.manual_seed(ctx.seed * 1000 + ctx.rank)
    return ctx.config, torch.device(ctx.device)


def load_model_and_tokenizer(path, dtype: str, device):
    """(model, tokenizer) of a local HF directory, the model in `dtype` on `device`."""
    from reranker.model import load_model

    model = load_model(path, dtype=getattr(torch, dtype), device=device)  # names a missing model dir
    return model, load_tokenizer(path)


def load_diffusion_model(ctx, block_size, dtype: str, note):
    """(model, tokenizer, block size, mask id) from a converted dir, converting a plain AR dir first
    (rank 0 writes run_dir/converted_input; every rank loads it). `note(text)` reports the
    conversion (the stages collect such lines until their logger exists)."""
    from transformers import AutoConfig

    from reranker.diffusion.convert import convert_to_diffusion, load_diffusion_config

    src = Path(ctx.input_dir)
    if load_diffusion_config(AutoConfig.from_pretrained(str(src), local_files_only=True)) is None:
        conv = Path(ctx.run_dir) / "converted_input"
        if ctx.is_main:
            convert_to_diffusion(src, conv, block_size=int(block_size or 32))
        D.barrier()
        note(f"{ctx.name}: {src.name} is a plain AR model: converted to block diffusion "
             f"(block size {block_size or 32}) in {conv.name}/")
        src = conv
    model, tok = load_model_and_tokenizer(src, dtype, torch.device(ctx.device))
    info = load_diffusion_config(model)
    B = int(block_size or info["block_size"])
    model.config.diffusion = {**info, "block_size": B}  # the output records the size it was trained for
    return model, tok, B, int(info["mask_token_id"])


def optimizer_and_scheduler(model, cfg: dict, warmup_steps: int, total_steps: int):
    """AdamW (decay on matrices only) and linear warm-up + cosine to `min_lr_ratio` over the run."""
    opt = build_optimizer(model, float(cfg["lr"]), float(cfg["weight_decay"]), cfg["betas"], float(cfg["eps"]))
    return opt, build_scheduler(opt, warmup_steps, max(total_steps, 1), float(cfg["min_lr_ratio"]))


def optimizer_step(model, opt, sched, max_grad_norm) -> tuple[float, float]:
    """Clip (null or 0: no clipping, grad_norm NaN), step, advance the schedule, drop the gradients.
    Returns (grad norm before clipping, the lr this step used)."""
    grad_norm = (float(torch.nn.utils.clip_grad_norm_(model.parameters(), float(max_grad_norm)))
                 if max_grad_norm else math.nan)
    lr = sched.get_last_lr()[0]
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return grad_norm, lr


# ---------------------------------------------------------------------------- one attempt

class Run:
    """One attempt at a stage: its checkpoints (resumed, or a clean start), its run logger and
    clock, and the stage output (the best model so far, or the last one).

    `state_cls` is the checkpointed loop position (TrainState or a subclass); `position` names its
    field the logger counts in (optimizer steps, or RL iterations). `notes`: lines from before the
    logger existed, written first; then, on resume, where the run picks up."""

    def __init__(self, ctx, model, tokenizer, opt, sched, total: int, *, state_cls=TrainState,
                 position: str = "step", notes=()):
        cfg = ctx.config
        self.ctx, self.model, self.tokenizer, self.opt, self.sched = ctx, model, tokenizer, opt, sched
        # Tagged with the config hash: a run dir reused with another config never resumes a stale state.
        self.ckpt = Checkpointer(Path(ctx.run_dir) / "checkpoints", (ctx.config_hash or "0")[:16],
                                 int(cfg["keep_checkpoints"]))
        loaded = self.ckpt.load_latest() if cfg["resume"] else None
        if loaded is not None:
            restore(loaded, model, opt, sched, ctx.rank, ctx.world_size)
            self.state = state_cls.from_dict(loaded["state"])
            del loaded
        else:
            self.state = state_cls()
            if ctx.is_main and Path(ctx.output_dir).exists():
                # Fresh start: whatever a stale attempt left in the .partial dir is not ours.
                for p in Path(ctx.output_dir).iterdir():
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        D.barrier()
        at = getattr(self.state, position)
        self.log = RunLogger(ctx.run_dir, enabled=ctx.is_main, progress=ctx.progress and ctx.is_main, total=total,
                             initial=at, desc=ctx.name, resume_step=at, resume_rows=self.state.metrics_rows)
        for line in notes:
            self.log.message(line)
        if at > 0:
            where = (f"epoch {self.state.epoch}, batch {self.state.batch_in_epoch}" if position == "step"
                     else f"optimizer step {self.state.step}")
            self.log.message(f"{ctx.name}: resuming at {position} {at}/{total} ({where})")
        self.resumed_from = at
        self._seconds_before, self._started = self.state.train_seconds, time.perf_counter()

    @property
    def resumed(self) -> bool:
        return self.resumed_from > 0

    def seconds(self) -> float:
        """Training seconds, summed over interrupted attempts."""
        return self._seconds_before + time.perf_counter() - self._started

    def snapshot(self) -> None:
        """Checkpoint the loop position, weights, optimizer and every rank's RNG (rank 0 writes)."""
        self.state.train_seconds = self.seconds()
        self.state.metrics_rows = self.log.rows_written  # what a resumed run keeps of metrics.jsonl
        rngs = D.all_gather_object(capture_rng())
        if self.ctx.is_main:
            self.ckpt.save(self.state, self.model, self.opt, self.sched, rngs)
        D.barrier()

    def keep_best(self, improved: bool) -> None:
        """An improved model becomes the stage output now (rank 0 writes; every rank waits), so a
        later kill still leaves the best model found in the .partial dir."""
        if improved and self.ctx.is_main:
            save_hf_dir(self.model, self.tokenizer, self.ctx.output_dir)
        D.barrier()

    def record_validation(self, val: dict, loss: float) -> None:
        """A supervised stage's validation: logged, remembered, kept as the output if `loss` is the
        lowest so far."""
        state = self.state
        state.last_val = val
        self.log.log(state.step, "valid", val)
        improved = loss < state.best_val
        if improved:
            state.best_val, state.best_step = loss, state.step
        self.keep_best(improved)

    def validation_summary(self, has_valid: bool, name: str, keys) -> dict:
        """What a supervised stage reports about validation: the best `name` (lowest; None without
        validation) and its step, the last validation's `keys`, the last training `name`."""
        state = self.state
        return {f"best_val_{name}": state.best_val if has_valid else None,
                "best_step": state.best_step if has_valid else state.step,
                **{f"last_val_{k}": state.last_val.get(k) for k in keys},
                f"last_train_{name}": state.last_train_loss}

    def finish(self, has_valid: bool, metrics: dict, resumed_key: str = "resumed_from_step") -> dict:
        """Without validation (or if the best model went missing) the last model is the output.
        Returns `metrics` plus what every stage reports: seconds, world size, where it resumed."""
        ctx = self.ctx
        if ctx.is_main and (not has_valid or not (Path(ctx.output_dir) / "config.json").exists()):
            save_hf_dir(self.model, self.tokenizer, ctx.output_dir)
        D.barrier()
        self.log.close()
        return {**metrics, "train_seconds": self.seconds(), "world_size": ctx.world_size,
                resumed_key: self.resumed_from}
