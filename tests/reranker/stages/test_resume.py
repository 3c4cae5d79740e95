"""A stage SIGKILLed mid-run resumes from its last checkpoint and ends where an uninterrupted
run ends: same optimizer steps, same losses.

The killed run is a subprocess with DGR2_FAULT_KILL_AFTER_STEP=3 (it SIGKILLs itself right
after optimizer step 3; checkpoints exist for step 2). Tolerance: final validation loss and
every per-step training loss within abs 1e-5 of the uninterrupted run (same thread count, so
in practice they are identical).
"""
import json
import os
import signal
import subprocess
import sys

import torch

from test_sft import make_sft_world
from reranker.stages.pipeline import run_stage
from reranker.training.checkpoint import FAULT_ENV
from reranker.training.logging import read_metrics

torch.set_num_threads(1)
TOL = 1e-5
# 8 examples / batch 4 = 2 steps per epoch, 3 epochs = 6 steps; checkpoints at steps 2, 4 (+ after each validation)
CFG = {"epochs": 3, "batch_size": 4, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 1, "save_every": 2,
       "eval_batch_size": 4, "max_len": 256}


def test_killed_stage_resumes_to_the_same_result(tmp_path):
    init, data = make_sft_world(tmp_path)
    ref = run_stage("sft", init, tmp_path / "ref", data, CFG, run_dir=tmp_path / "ref_run", progress=False,
                    device="cpu")
    assert ref["optimizer_steps"] == 6

    out, run = tmp_path / "out", tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", FAULT_ENV: "3"}
    cmd = [sys.executable, "-m", "reranker.stages.pipeline", "--stage", "sft", "--input", str(init),
           "--output", str(out), "--data", str(data), "--run-dir", str(run), "--no-progress", "--device", "cpu",
           "--config-json", json.dumps(CFG)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not out.exists() and (tmp_path / "out.partial").is_dir()  # nothing looks finished
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.pt"))
    assert ckpts and ckpts[-1].startswith("step00000002-"), ckpts
    assert [r["step"] for r in read_metrics(run, "train")] == [1, 2, 3]  # step 3 ran, then the kill

    res = run_stage("sft", init, out, data, CFG, run_dir=run, progress=False, device="cpu")
    assert res["status"] == "done" and res["config_hash"] == ref["config_hash"]  # the output path is not identity
    assert res["optimizer_steps"] == ref["optimizer_steps"] == 6
    assert res["metrics"]["resumed_from_step"] == 2 and ref["metrics"]["resumed_from_step"] == 0
    assert abs(res["metrics"]["last_val_loss"] - ref["metrics"]["last_val_loss"]) < TOL
    assert abs(res["metrics"]["best_val_loss"] - ref["metrics"]["best_val_loss"]) < TOL

    # The log has each step once (the killed run's step 3 row was dropped and redone).
    a, b = read_metrics(tmp_path / "ref_run", "train"), read_metrics(run, "train")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert all(abs(x["loss"] - y["loss"]) < TOL for x, y in zip(a, b))
    assert [r["step"] for r in read_metrics(run, "valid")] == [2, 4, 6]
    assert json.loads((out / "stage_done.json").read_text())["optimizer_steps"] == 6

    # Finished: asking again skips.
    again = run_stage("sft", init, out, data, CFG, run_dir=run, progress=False, device="cpu")
    assert again["status"] == "skipped"
