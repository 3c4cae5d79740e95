"""Scoped compatibility shim for RecBole 1.2.1 on numpy 2 and torch >= 2.6.

RecBole's Config sets `np.float = np.float_` etc. (aliases numpy 2 removed), and its Trainer loads
its own checkpoints with `torch.load` (weights_only now defaults to True). Both are patched only
for the duration of a `with recbole_compat():` block and restored afterwards, so no other code in
the process sees a modified numpy or torch. RecBole's TensorBoard writer is redirected into the run
directory instead of `./log_tensorboard`.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

# numpy 2 removed these; RecBole's Config reads them to build its own (also removed) aliases.
_NUMPY_ALIASES = {"float_": np.float64, "complex_": np.complex128, "unicode_": np.str_, "bool8": np.bool_}
# ...and then assigns these, which we undo on exit.
_RECBOLE_ASSIGNS = ("bool", "int", "float", "complex", "object", "str", "long", "unicode")
_MISSING = object()


@contextlib.contextmanager
def recbole_compat(tensorboard_dir: str | None = None):
    saved = {n: np.__dict__.get(n, _MISSING) for n in (*_NUMPY_ALIASES, *_RECBOLE_ASSIGNS)}
    original_load = torch.load

    @functools.wraps(original_load)
    def load_recbole_checkpoint(*args, **kwargs):
        # Only RecBole's own checkpoints pass through here (it pickles its config in them).
        kwargs.setdefault("weights_only", False)
        return original_load(*args, **kwargs)

    import recbole.trainer.trainer as rb_trainer  # noqa: E402  (import under the shim)

    original_tb = rb_trainer.get_tensorboard
    for name, value in _NUMPY_ALIASES.items():
        if saved[name] is _MISSING:
            setattr(np, name, value)
    torch.load = load_recbole_checkpoint
    if tensorboard_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        rb_trainer.get_tensorboard = lambda logger: SummaryWriter(tensorboard_dir)
    try:
        yield
    finally:
        torch.load = original_load
        rb_trainer.get_tensorboard = original_tb
        for name, value in saved.items():
            if value is _MISSING:
                np.__dict__.pop(name, None)
            else:
                setattr(np, name, value)
