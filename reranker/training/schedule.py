"""AdamW with linear warm-up then cosine decay, as a plain LambdaLR.

The multiplier is a small callable object rather than a closure: LambdaLR.state_dict() keeps
the __dict__ of callable objects, so a resumed scheduler is checkable against the saved one.
"""
from __future__ import annotations

import math

import torch


class WarmupCosine:
    """lr multiplier: 0 -> 1 linearly over `warmup_steps`, then cosine from 1 to `min_ratio`
    at `total_steps` (held there after)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
        self.warmup_steps = max(0, int(warmup_steps))
        self.total_steps = int(total_steps)
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        # LambdaLR calls this with the number of scheduler.step() calls so far; the lr used for
        # optimizer step k (0-based) is f(k), so step 0 of a warm-up gets a small but nonzero lr.
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps_from(config: dict, total_steps: int) -> int:
    """`warmup_steps` if given, else `warmup_ratio` of the total."""
    if config.get("warmup_steps") is not None:
        return int(config["warmup_steps"])
    return int(round(float(config.get("warmup_ratio", 0.0)) * total_steps))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on biases and norm gains (1-D), as in nanoGPT.
    Tied parameters appear once (named_parameters de-duplicates)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0,
                    betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    # foreach=False: the per-tensor loop is deterministic and just as fast for small CPU models.
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, foreach=False)


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_ratio))
