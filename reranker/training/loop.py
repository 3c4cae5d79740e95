"""The epoch loop every supervised stage shares (sft, cft, opd): batch plan, batch order, epoch
ends, the per-step cadence of validations and checkpoints, resume.

The shuffled order is a function of (seed, epoch), and the position inside the epoch lives in the
checkpointed TrainState, so a resumed run continues with exactly the batch it would have seen.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import distributed as D


def accumulation(cfg: dict, world_size: int) -> tuple[int, int]:
    """(grad_accum, per-rank micro-batch size) for this world size."""
    g = int(cfg["batch_size"])
    if cfg.get("micro_batch_size"):
        m = int(cfg["micro_batch_size"])
        if g % (world_size * m):
            raise ValueError(f"batch_size {g} is not a multiple of world_size {world_size} x micro_batch_size {m}")
        return g // (world_size * m), m
    a = int(cfg["grad_accum"])
    if g % (world_size * a):
        raise ValueError(f"batch_size {g} is not a multiple of world_size {world_size} x grad_accum {a}")
    return a, g // (world_size * a)


@dataclass(frozen=True)
class EpochPlan:
    """How `n_examples` become optimizer steps: one step = one global batch of `batch_size`
    examples whatever the world size, each rank running `grad_accum` micro-batches of
    `micro_batch_size`; the last incomplete global batch of an epoch is dropped."""
    n_examples: int
    batch_size: int
    grad_accum: int
    micro_batch_size: int
    steps_per_epoch: int
    total: int  # optimizer steps of the whole run (epochs, capped by max_steps)


def epoch_plan(cfg: dict, n_examples: int, world_size: int, what: str = "training examples") -> EpochPlan:
    G = int(cfg["batch_size"])
    accum, micro = accumulation(cfg, world_size)
    steps_per_epoch = n_examples // G
    if steps_per_epoch == 0:
        raise ValueError(f"{n_examples} {what}, fewer than one global batch of {G}")
    total = int(cfg["epochs"]) * steps_per_epoch
    if cfg["max_steps"] is not None:
        total = min(total, int(cfg["max_steps"]))
    return EpochPlan(n_examples, G, accum, micro, steps_per_epoch, total)


def scheduled_batches(state, plan: EpochPlan, seed: int, validate: Callable[[], None],
                      snapshot: Callable[[], None]) -> Iterator[list[int]]:
    """Yield the global batch (example indices) of every remaining optimizer step.

    The caller trains on it and then advances `state.step` and `state.batch_in_epoch`. At the end
    of each epoch and of training, `validate()` then `snapshot()` run once per step.
    """
    order_epoch, batches = None, None
    while True:
        if state.batch_in_epoch >= plan.steps_per_epoch or state.step >= plan.total:
            if state.validated_step != state.step:
                state.validated_step = state.step  # first: the checkpoint must record it
                validate()
                snapshot()
            if state.step >= plan.total:
                return
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            continue
        if order_epoch != state.epoch:
            batches = D.global_batches(D.epoch_order(plan.n_examples, seed, state.epoch), plan.batch_size)
            order_epoch = state.epoch
        yield batches[state.batch_in_epoch]


def after_step(state, cfg: dict, total: int, validate: Callable[[], None], snapshot: Callable[[], None]) -> None:
    """The per-step cadence: validate + checkpoint every `eval_every` steps, else checkpoint every
    `save_every` steps; then the test hook that can kill the process at a chosen step."""
    from .checkpoint import fault_point

    if cfg["eval_every"] and state.step % int(cfg["eval_every"]) == 0 and state.step < total:
        state.validated_step = state.step  # first: the checkpoint must record it
        validate()
        snapshot()
    elif cfg["save_every"] and state.step % int(cfg["save_every"]) == 0:
        snapshot()
    fault_point(state.step)
