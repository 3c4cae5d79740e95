"""Rank-0 run logging: TensorBoard scalars, a metrics.jsonl twin, and a tqdm bar.

Every rank may call these methods; only rank 0 writes, so the training loop needs no
`if rank == 0` around each log line. metrics.jsonl carries the same scalars as TensorBoard in
a form tests and reports can read without the tensorboard package.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


class RunLogger:
    def __init__(self, run_dir, enabled: bool = True, progress: bool = False, total: int = 0,
                 initial: int = 0, desc: str = "", resume_step: int = 0, resume_rows: int = 0):
        """`resume_step` / `resume_rows`: the optimizer step a resumed run starts from and the
        number of metrics.jsonl rows written when that checkpoint was taken (`rows_written`).
        What the interrupted run logged after its checkpoint is dropped, so curves have no
        duplicates; a fresh run (0, 0) starts empty files."""
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.writer = None
        self.bar = None
        self._jsonl = None
        self.rows_written = resume_rows
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        _truncate_jsonl(path, resume_rows)
        self._jsonl = open(path, "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a declared dependency; still, never fail a run on logging
            print("tensorboard not installed: logging to metrics.jsonl only", file=sys.stderr)
        else:
            # purge_step: TensorBoard hides events the interrupted run wrote past the checkpoint.
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step or None)
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=False)

    def log(self, step: int, kind: str, metrics: dict) -> None:
        """Scalars under `<kind>/<name>` in TensorBoard and one JSON row."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if self.writer is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.writer.add_scalar(f"{kind}/{k}", v, step)
        self._jsonl.write(json.dumps({"kind": kind, "step": int(step), **clean}) + "\n")
        self._jsonl.flush()
        self.rows_written += 1

    def progress(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                     refresh=False)
            self.bar.update(n)

    def message(self, text: str) -> None:
        """A line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_metrics(run_dir, kind: str | None = None) -> list[dict]:
    """Rows of `<run_dir>/metrics.jsonl`, optionally of one kind ("train", "valid", ...)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a last line cut by a kill mid-write
            continue
    return [r for r in rows if kind is None or r.get("kind") == kind]


def _truncate_jsonl(path: Path, keep_rows: int) -> None:
    """Keep the first `keep_rows` rows (a fresh run keeps none). Rewritten via a temp file and
    rename, so a kill during the rewrite leaves the old file intact."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()[:keep_rows] if keep_rows > 0 else []
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
