"""Scoped compatibility shim for RecBole 1.2.1 on numpy 2, and a guard against its pickle caches.

RecBole's Config sets `np.float = np.float_` etc. (aliases numpy 2 removed); the aliases it needs
are provided only for the duration of a `with recbole_compat():` block and restored afterwards, so
no other code in the process sees a modified numpy. RecBole's TensorBoard writer is redirected into
the run directory instead of `./log_tensorboard`.

RecBole's chatter is dropped inside the block, and only there: the FutureWarnings its code triggers
(pandas' chained-assignment warning for `fillna(inplace=True)` on every dataset load, torch's
`torch.cuda.amp.GradScaler` deprecation in its Trainer), its INFO lines (it logs to the root logger:
dataloader settings, per-epoch losses and validation results), and its warning that our command
line "will not be used in RecBole" (it reads sys.argv for `--key=value` overrides). Its other
warnings pass. The warnings filter lives in a `warnings.catch_warnings()` and the log filter is
removed on exit, so code outside the block sees both as before.

Nothing is unpickled inside the block. `create_dataset` and `data_preparation` unpickle a cached
dataset / dataloaders file whenever one exists in `checkpoint_dir` (`<dataset>-SequentialDataset.pth`,
`<dataset>-for-<model>-dataloader.pth`) or at `dataset_save_path` / `dataloaders_save_path`; a crafted
file there (a served retrieval directory's sasrec/, say) would run code. Inside the block those loads
raise a ValueError naming the file instead (this project never writes such caches). torch.load keeps
its safe default (weights_only=True): SASRec weights are stored as safetensors (candidate_gen/sasrec.py),
RecBole's Trainer keeps its best model in memory there, and no code path here calls the Trainer's own
loads (`resume_checkpoint`, `evaluate(load_best_model=True)`).

Importing `recbole.model.sequential_recommender` runs RecBole's `sine.py`, which calls
`torch.autograd.set_detect_anomaly(True)` for the whole process: every later backward pass then
records and checks its graph, and the demo's SFT and CFT steps ran 2.2x slower after retrieval
(docs/EXPERIMENTS.md). `torch_anomaly_mode_kept()` restores the mode around such an import, and
`recbole_compat()` around its block.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import types
import warnings

import numpy as np

# numpy 2 removed these; RecBole's Config reads them to build its own (also removed) aliases.
_NUMPY_ALIASES = {"float_": np.float64, "complex_": np.complex128, "unicode_": np.str_, "bool8": np.bool_}
# ...and then assigns these, which we undo on exit.
_RECBOLE_ASSIGNS = ("bool", "int", "float", "complex", "object", "str", "long", "unicode")
_MISSING = object()


def _refuse_unpickling(f, *args, **kwargs):
    name = getattr(f, "name", f)
    raise ValueError(f"{name}: a pickled RecBole dataset/dataloader cache, which is not loaded (unpickling a "
                     "file can run code); delete it (this project never writes one; RecBole rebuilds the "
                     "dataset from the atomic files)")


# What recbole.data.utils sees as `pickle` inside the block: dumps as before, never loads.
_NO_LOAD_PICKLE = types.SimpleNamespace(dump=pickle.dump, dumps=pickle.dumps, load=_refuse_unpickling,
                                        loads=_refuse_unpickling, HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL)


def _not_recbole_chatter(record: logging.LogRecord) -> bool:
    """A filter for the root logger, which RecBole logs to (`getLogger()`); records of named loggers
    (ours) reach the root's handlers without passing through it."""
    return record.levelno >= logging.WARNING and not str(record.msg).startswith("command line args [")


@contextlib.contextmanager
def torch_anomaly_mode_kept():
    """Whatever the block does to torch's anomaly detection (RecBole's model imports turn it on),
    it is as before on exit."""
    import torch

    mode, check_nan = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(mode, check_nan)


@contextlib.contextmanager
def recbole_compat(tensorboard_dir: str | None = None):
    with torch_anomaly_mode_kept():
        with _recbole_compat(tensorboard_dir):
            yield


@contextlib.contextmanager
def _recbole_compat(tensorboard_dir: str | None = None):
    saved = {n: np.__dict__.get(n, _MISSING) for n in (*_NUMPY_ALIASES, *_RECBOLE_ASSIGNS)}

    import recbole.data.utils as rb_data_utils  # noqa: E402
    import recbole.trainer.trainer as rb_trainer  # noqa: E402

    original_tb = rb_trainer.get_tensorboard
    original_pickle = rb_data_utils.pickle
    for name, value in _NUMPY_ALIASES.items():
        if saved[name] is _MISSING:
            setattr(np, name, value)
    rb_data_utils.pickle = _NO_LOAD_PICKLE
    if tensorboard_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        rb_trainer.get_tensorboard = lambda logger: SummaryWriter(tensorboard_dir)
    root = logging.getLogger()
    root.addFilter(_not_recbole_chatter)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"recbole\.")
            yield
    finally:
        root.removeFilter(_not_recbole_chatter)
        rb_data_utils.pickle = original_pickle
        rb_trainer.get_tensorboard = original_tb
        for name, value in saved.items():
            if value is _MISSING:
                np.__dict__.pop(name, None)
            else:
                setattr(np, name, value)
