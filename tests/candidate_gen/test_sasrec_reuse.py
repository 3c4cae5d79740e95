"""A finished SASRec checkpoint is reused only when it was trained with the same settings."""

import json

import torch

from candidate_gen.sasrec import _reuse_checkpoint, save_weights


def test_reuse_only_matching_checkpoints(tmp_path):
    done, info = tmp_path / "sasrec.safetensors", tmp_path / "train_info.json"
    settings = {"dataset": "d", "params": {"hidden_size": 4}, "seed": 0}
    assert _reuse_checkpoint(done, info, settings, torch.nn.Linear(4, 4), "cpu") is None  # nothing there
    save_weights(done, torch.nn.Linear(4, 4).state_dict())
    info.write_text(json.dumps({"train_seconds": 7.0, "settings": settings}))
    assert _reuse_checkpoint(done, info, settings, torch.nn.Linear(4, 4), "cpu") == 7.0
    other = {**settings, "params": {"hidden_size": 8}}
    assert _reuse_checkpoint(done, info, other, torch.nn.Linear(4, 4), "cpu") is None
    info.write_text(json.dumps({"train_seconds": 7.0}))  # recorded before settings were: try the weights
    assert _reuse_checkpoint(done, info, other, torch.nn.Linear(4, 4), "cpu") == 7.0
    assert _reuse_checkpoint(done, info, other, torch.nn.Linear(8, 8), "cpu") is None
