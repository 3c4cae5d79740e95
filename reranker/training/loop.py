"""The epoch loop every supervised stage shares (sft, cft, opd): batch order, epoch ends, resume.

The shuffled order is a function of (seed, epoch), and the position inside the epoch lives in the
checkpointed TrainState, so a resumed run continues with exactly the batch it would have seen.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from . import distributed as D


def scheduled_batches(state, n_examples: int, batch_size: int, seed: int, steps_per_epoch: int, total: int,
                      at_epoch_end: Callable[[], None]) -> Iterator[list[int]]:
    """Yield the global batch (example indices) of every remaining optimizer step.

    The caller trains on it and then advances `state.step` and `state.batch_in_epoch`. At the end
    of each epoch and of training, `at_epoch_end()` (validate, checkpoint) runs once per step.
    """
    order_epoch, batches = None, None
    while True:
        if state.batch_in_epoch >= steps_per_epoch or state.step >= total:
            if state.validated_step != state.step:
                state.validated_step = state.step  # first: at_epoch_end's checkpoint must record it
                at_epoch_end()
            if state.step >= total:
                return
            state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            continue
        if order_epoch != state.epoch:
            batches = D.global_batches(D.epoch_order(n_examples, seed, state.epoch), batch_size)
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


def finish(ctx, model, tokenizer, has_valid: bool, log) -> None:
    """Without a validation set (or if the best snapshot went missing) the last model is the output."""
    from . import distributed as D
    from .checkpoint import save_hf_dir

    if ctx.is_main and (not has_valid or not (Path(ctx.output_dir) / "config.json").exists()):
        save_hf_dir(model, tokenizer, ctx.output_dir)
    D.barrier()
    log.close()
