"""Resumable training state (checkpoints) and model-directory saving.

A checkpoint is one file, `<run_dir>/checkpoints/step00000040-<tag>.pt`, holding the model
and optimizer/scheduler state, every rank's RNG states and the loop position (step, epoch,
global batch within the epoch's shuffled order, best validation loss so far). It is written to
a temp file and renamed, so a kill never leaves a half checkpoint that looks whole. `tag` is the
stage's config hash: a run dir reused with a different config never resumes from a stale state.

Loading uses torch.load(weights_only=True): everything saved here is tensors and plain Python
data (the numpy RNG state is converted to lists for that reason).
"""
from __future__ import annotations

import os
import random
import re
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from reranker.model import save_model
from reranker.text.tokenizer import load_tokenizer

FORMAT = 1
_NAME = re.compile(r"^step(\d{8})-([0-9a-f]+)\.pt$")


# ---------------------------------------------------------------------------- model directories

def save_hf_dir(model, tokenizer, path) -> Path:
    """save_pretrained (safetensors) + tokenizer, written aside and renamed into place."""
    return save_model(model, tokenizer, path)


# ---------------------------------------------------------------------------- RNG

def capture_rng() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- loop position

@dataclass
class TrainState:
    """Where the loop is. `batch_in_epoch` indexes the epoch's global batches (world-size
    independent), so resuming continues with exactly the batch the interrupted run would
    have taken next."""
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0
    best_val: float = float("inf")
    best_step: int = -1
    validated_step: int = -1  # step of the last validation (not redone on resume)
    last_val: dict = field(default_factory=dict)  # that validation's metrics
    last_train_loss: float | None = None
    train_seconds: float = 0.0  # summed over interrupted attempts
    metrics_rows: int = 0  # rows in metrics.jsonl at save time (later rows are dropped on resume)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------------------- checkpoints

class Checkpointer:
    def __init__(self, directory, tag: str, keep: int = 2):
        if not re.fullmatch(r"[0-9a-f]+", tag):
            raise ValueError(f"checkpoint tag must be hex (a config hash), got {tag!r}")
        self.dir = Path(directory)
        self.tag = tag
        self.keep = max(1, int(keep))

    def _listing(self) -> list[tuple[int, str, Path]]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append((int(m.group(1)), m.group(2), p))
        return sorted(out)

    def paths(self) -> list[Path]:
        """This tag's checkpoints, oldest first."""
        return [p for _, tag, p in self._listing() if tag == self.tag]

    def latest(self) -> Path | None:
        ps = self.paths()
        return ps[-1] if ps else None

    def load_latest(self, map_location="cpu") -> dict | None:
        """The newest readable checkpoint of this tag, or None (fresh start)."""
        for path in reversed(self.paths()):
            try:
                ckpt = torch.load(path, map_location=map_location, weights_only=True)
            except Exception as exc:  # unreadable (should not happen with atomic writes): try older
                print(f"skipping unreadable checkpoint {path.name}: {exc}", flush=True)
                continue
            if ckpt.get("format") == FORMAT and ckpt.get("tag") == self.tag:
                return ckpt
        return None

    def save(self, state: TrainState, model, optimizer, scheduler, rng_states: list) -> Path:
        """Call on rank 0 only (gather `rng_states` from all ranks first)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": FORMAT,
            "tag": self.tag,
            "state": asdict(state),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_states,
        }
        path = self.dir / f"step{state.step:08d}-{self.tag}.pt"
        tmp = self.dir / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        torch.save(payload, tmp)
        os.replace(tmp, path)
        self._prune()
        return path

    def _prune(self) -> None:
        # Keep this tag's newest `keep`; other tags are stale configs of the same run dir.
        mine = self.paths()
        stale = [p for _, tag, p in self._listing() if tag != self.tag]
        for p in mine[:-self.keep] + stale:
            p.unlink(missing_ok=True)
        for p in self.dir.glob(".*.tmp-*"):  # temp files of killed writers
            p.unlink(missing_ok=True)


def export_checkpoint(checkpoint, like, out) -> Path:
    """A model directory (safetensors + tokenizer) from a training checkpoint: the architecture,
    config and tokenizer of `like` (the stage's input model dir), the weights of `checkpoint`.
    A stage writes its output dir only when it finishes; this probes one that is still running or
    was stopped (`dgr2 model export`)."""
    from reranker.model import load_model

    path = Path(checkpoint)
    if not _NAME.match(path.name) or not path.is_file():
        raise ValueError(f"{path}: not a training checkpoint file (<run>/checkpoints/stepNNNNNNNN-<tag>.pt)")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or "model" not in ckpt:
        raise ValueError(f"{path}: not a training checkpoint of format {FORMAT}")
    model = load_model(like)
    mine = model.state_dict()
    theirs = ckpt["model"]
    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    resized = [f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
               if k in theirs and tuple(theirs[k].shape) != tuple(v.shape)]
    if missing or unexpected or resized:
        raise ValueError(f"{path} does not fit the model of {like}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}, other shapes {resized[:3]}")
    model.load_state_dict(theirs)
    return save_model(model, load_tokenizer(like), out)


def restore(ckpt: dict, model, optimizer, scheduler, rank: int, world_size: int) -> TrainState:
    """Load a checkpoint into live objects; returns the loop position.

    RNG states are restored per rank when the world size matches; on a different world size
    ranks beyond the saved ones keep their fresh seeding (data order never depends on them)."""
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt.get("scheduler") is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    rngs = ckpt.get("rng") or []
    if rank < len(rngs) and (len(rngs) == world_size or rank == 0):
        restore_rng(rngs[rank])
    return TrainState.from_dict(ckpt["state"])


# ---------------------------------------------------------------------------- fault injection

FAULT_ENV = "DGR2_FAULT_KILL_AFTER_STEP"


def fault_point(step: int) -> None:
    """Resume tests: with DGR2_FAULT_KILL_AFTER_STEP=k in the environment, the process
    SIGKILLs itself right after optimizer step k (and any checkpoint of that step): no
    finally blocks, no flushing, as a machine loss would. An env var, not a config key, so
    the killed and the resumed run share one config hash."""
    k = os.environ.get(FAULT_ENV)
    if k is not None and int(k) == step:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
