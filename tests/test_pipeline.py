"""`dgr2 pipeline` end to end on tiny synthetic data and tiny models, and its skip-when-done."""
from pathlib import Path

import pytest

from integration.pipeline import format_summary, run_full_pipeline

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_catalog):
    out = tmp_path_factory.mktemp("pipe") / "out"
    return {
        "name": "tiny", "seed": 0, "out": str(out),
        "data": {"dir": str(tiny_catalog)},
        "retrieval": {"crossfit_folds": 2, "sasrec": {"epochs": 1, "hidden_size": 16, "inner_size": 32, "n_layers": 1,
                                                      "n_heads": 1, "train_batch_size": 256,
                                                      "MAX_ITEM_LIST_LENGTH": 20}},
        "rerank_data": {"n_selection_users": 60, "tokenizer_vocab": 500, "max_train_examples": 40},
        "model": {"size": TINY},
        "convert": {"block_size": 8},
        "stages": {
            "copy_warmup": {"epochs": 1, "batch_size": 8},
            "sft": {"epochs": 1, "batch_size": 8, "max_valid_examples": 8},
            "ar_rl": {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_valid_examples": 4,
                      "max_new_tokens": 16, "max_draw_rounds": 1},
            "cft": {"epochs": 1, "batch_size": 8, "max_valid_examples": 8, "decode_examples": 2},
            "opd": {"max_steps": 1, "batch_size": 1, "group_size": 2, "max_new_tokens": 16, "eval_examples": 2,
                    "max_valid_examples": 4},
            "rl": {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_valid_examples": 4,
                   "max_new_tokens": 16, "max_draw_rounds": 1},
        },
        "eval": {"limit": 6, "batch_size": 3, "max_new_tokens": 16, "n_boot": 50},
    }


def test_pipeline_runs_every_stage_then_skips(config, capsys):
    summary = run_full_pipeline(config)
    names = [r["name"] for r in summary["rows"]]
    assert names == ["retriever order", "AR GR2 (sft)", "AR GR2", "naive conversion", "+CFT", "+CFT+OPD",
                     "+CFT+OPD+RL"]
    for row in summary["rows"][1:]:
        assert 0.0 <= row["recall@1"] <= 1.0 and 0.0 <= row["valid_rate"] <= 1.0
        assert row["tokens_per_second"] > 0
    assert "retriever order" in format_summary(summary)
    assert list(summary["stage_wall_seconds"]) == ["copy_warmup", "sft", "ar_rl", "cft", "opd", "rl"]
    assert (Path(config["out"]) / "rerank_data" / "copy_warmup.jsonl").is_file()
    capsys.readouterr()
    again = run_full_pipeline(config)
    log = capsys.readouterr().out
    assert "retrieval: up to date, skipped" in log and "data: up to date, skipped" in log
    assert [r["recall@1"] for r in again["rows"]] == [r["recall@1"] for r in summary["rows"]]
    # Training stages were skipped too: the stage outputs carry the first run's wall-clock.
    assert again["stage_wall_seconds"] == summary["stage_wall_seconds"]
    assert "skipped" in log


def test_copy_warmup_phases_build_their_own_files(tmp_path):
    import json

    from integration.pipeline import copy_warmup_specs, warmup_label
    from tests.test_copy_warmup import SIDS

    rows = [{"candidate_sids": SIDS, "prompt_messages": [{"role": "user", "content": "x\nRank all 10."}],
             "assistant": "y"} for _ in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = copy_warmup_specs([{"build": {"straight": 5}, "max_steps": 7},
                               {"build": {"full_prompt": True, "random_sids": True}, "lr": 1e-3}], tmp_path, 0)
    assert [s["id"] for s in specs] == ["00_copy_warmup", "01_copy_warmup"]
    assert [s["config"]["train_file"] for s in specs] == ["copy_warmup-straight5.jsonl",
                                                          "copy_warmup-full_prompt-random_sids.jsonl"]
    assert specs[0]["config"]["max_steps"] == 7 and "build" not in specs[0]["config"]
    assert len((tmp_path / "copy_warmup-straight5.jsonl").read_text().splitlines()) == 5
    assert copy_warmup_specs({"epochs": 1}, tmp_path, 0)[0]["config"]["train_file"] == "copy_warmup.jsonl"
    assert [warmup_label(i, 2) for i in range(2)] == ["copy_warmup_1", "copy_warmup_2"]
    (spec,) = copy_warmup_specs({"build": {"random_sids": True, "limit": 2}}, tmp_path, 0)
    assert len((tmp_path / spec["config"]["train_file"]).read_text().splitlines()) == 2
    with pytest.raises(ValueError, match=r"copy_warmup\[0\].build: unknown key\(s\) \['shuffle'\]"):
        copy_warmup_specs({"build": {"shuffle": True}}, tmp_path, 0)
    with pytest.raises(ValueError, match=r"copy_warmup\[1\]: expected a mapping"):
        copy_warmup_specs([{}, "fast"], tmp_path, 0)
