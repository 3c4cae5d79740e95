"""Mixed precision (training/precision.py): a clear error for an unknown setting, bf16 matmuls under
"bf16" and none under "none", and an sft / cft step under bf16 that changes the loss only by rounding."""
import pytest
import torch

from test_cft import world as cft_world  # noqa: F401  (fixture)
from test_sft import FAST
from test_sft import world as sft_world  # noqa: F401  (fixture)
from reranker.stages.pipeline import run_stage
from reranker.training.logging import read_metrics
from reranker.training.precision import autocast, check_autocast


def test_unknown_setting_names_the_choices():
    with pytest.raises(ValueError, match=r"autocast must be one of \['bf16', 'none'\], got 'fp16'"):
        check_autocast("fp16")
    from reranker.stages.sft import DEFAULTS, check_config

    with pytest.raises(ValueError, match="autocast"):
        check_config({**DEFAULTS, "autocast": "float16"})


def test_bf16_runs_matmuls_in_bf16_and_none_does_not():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with autocast("bf16", "cpu"):
        assert lin(x).dtype == torch.bfloat16
    with autocast("none", "cpu"):
        assert lin(x).dtype == torch.float32


def _first_losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir, "train")]


@pytest.mark.parametrize("stage", ["sft", "cft"])
def test_bf16_step_matches_fp32_up_to_rounding(stage, sft_world, cft_world, tmp_path):  # noqa: F811
    if stage == "sft":
        (init, data), cfg = sft_world, {**FAST, "epochs": 1, "valid_file": None}
    else:
        (_, init, data), cfg = cft_world, {"epochs": 1, "batch_size": 4, "lr": 1e-3, "save_every": 0,
                                           "valid_file": None, "max_len": 256}
    losses = {}
    for ac in ("none", "bf16"):
        run = tmp_path / f"run-{ac}"
        s = run_stage(stage, init, tmp_path / f"out-{ac}", data, {**cfg, "autocast": ac}, run_dir=run, progress=False,
                      device="cpu")
        assert s["status"] == "done"
        losses[ac] = _first_losses(run)
    assert len(losses["bf16"]) == len(losses["none"]) >= 1
    a, b = losses["none"][0], losses["bf16"][0]  # same weights, same batch: only the rounding differs
    assert a != b and abs(a - b) < 0.02 * abs(a), (a, b)


def test_training_step_cost_reports_both_settings_and_keeps_the_weights():
    from reranker.eval.speed import training_step_cost
    from reranker.model import build_model

    model = build_model(40, "tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rep = training_step_cost(model, batch_size=2, length=8, iters=2, warmup=1)
    assert [r["autocast"] for r in rep["rows"]] == ["none", "bf16"] and all(r["seconds"]["n"] == 2 for r in rep["rows"])
    assert rep["speedup"] == rep["rows"][0]["seconds"]["median"] / rep["rows"][1]["seconds"]["median"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
