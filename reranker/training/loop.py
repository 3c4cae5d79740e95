"""The epoch loop every supervised stage shares (sft, cft, opd): batch order, epoch ends, resume.

The shuffled order is a function of (seed, epoch), and the position inside the epoch lives in the
checkpointed TrainState, so a resumed run continues with exactly the batch it would have seen.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

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
