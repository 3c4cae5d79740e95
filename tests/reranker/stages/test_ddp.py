"""The SFT stage under torchrun (2 processes, gloo, CPU) reproduces the 1-process run.

Same global batch (4 examples per optimizer step): 1 process does 2 micro-batches of 2 with
gradient accumulation, 2 processes do 1 micro-batch of 2 each. Dropout is off (the tiny Qwen3
config has attention_dropout 0), so the only difference is the order of float additions.

Tolerance: per-step training loss and per-epoch validation loss within abs 1e-4, final
weights within abs 1e-4. Measured on this machine: training losses bit-identical, validation
losses within ~5e-7 (padding to different lengths in the strided validation shards).
"""
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from test_sft import make_sft_world
from reranker.stages.pipeline import run_stage
from reranker.training.logging import read_metrics

torch.set_num_threads(1)
TOL = 1e-4
CFG = {"epochs": 2, "batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "save_every": 2, "eval_batch_size": 4,
       "max_len": 256}


def test_torchrun_two_processes_match_one_process(tmp_path):
    init, data = make_sft_world(tmp_path)

    one = run_stage("sft", init, tmp_path / "out1", data, {**CFG, "grad_accum": 2}, run_dir=tmp_path / "run1",
                    progress=False, device="cpu")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "reranker.stages.pipeline", "--stage", "sft", "--input", str(init), "--output", str(tmp_path / "out2"),
           "--data", str(data), "--run-dir", str(tmp_path / "run2"), "--no-progress", "--device", "cpu",
           "--config-json", json.dumps({**CFG, "grad_accum": 1})]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    done = json.loads((tmp_path / "out2" / "stage_done.json").read_text())
    assert done["world_size"] == 2 and done["optimizer_steps"] == one["optimizer_steps"] == 4
    data_row = read_metrics(tmp_path / "run2", "data")[0]
    assert data_row["world_size"] == 2 and data_row["grad_accum"] == 1 and data_row["micro_batch_size"] == 2

    for kind in ("train", "valid"):
        a = read_metrics(tmp_path / "run1", kind)
        b = read_metrics(tmp_path / "run2", kind)
        assert [r["step"] for r in a] == [r["step"] for r in b] and a
        for ra, rb in zip(a, b):
            assert abs(ra["loss"] - rb["loss"]) < TOL, (kind, ra, rb)
    w1 = load_file(str(tmp_path / "out1" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "out2" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < TOL


def test_global_batches_are_world_size_independent():
    from reranker.training.distributed import epoch_order, global_batches, rank_micro_batches

    order = epoch_order(22, seed=5, epoch=3)
    assert sorted(order) == list(range(22)) and order == epoch_order(22, seed=5, epoch=3) != epoch_order(22, 5, 4)
    for batch in global_batches(order, 8):  # 2 full batches, the tail of 6 is dropped
        one = rank_micro_batches(batch, 0, 1, 4)
        two = [mb for r in range(2) for mb in rank_micro_batches(batch, r, 2, 2)]
        four = [mb for r in range(4) for mb in rank_micro_batches(batch, r, 4, 1)]
        assert one == two == four and [i for mb in one for i in mb] == batch
    assert len(global_batches(order, 8)) == 2
