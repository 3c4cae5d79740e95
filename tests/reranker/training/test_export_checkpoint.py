"""`dgr2 model export`: a model directory from a training checkpoint, for probing a running stage."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from reranker.model import build_model, save_model
from reranker.text.tokenizer import build_tokenizer
from reranker.training.checkpoint import Checkpointer, TrainState, export_checkpoint


def test_export_checkpoint_round_trip_and_clear_errors(tmp_path):
    tok = build_tokenizer(["History Candidates cobought brand category"] * 3, vocab_size=300)
    base = build_model(len(tok), size="tiny")
    save_model(base, tok, tmp_path / "input")
    trained = build_model(len(tok), size="tiny")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5)  # weights that differ from the input model's
    opt = torch.optim.AdamW(trained.parameters())
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", "abc123").save(TrainState(step=40), trained, opt, None, [])
    out = export_checkpoint(ckpt, tmp_path / "input", tmp_path / "probe")
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    for (name, a), b in zip(loaded.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name
    assert (out / "tokenizer_config.json").is_file()

    with pytest.raises(ValueError, match="not a training checkpoint file"):
        export_checkpoint(tmp_path / "input" / "model.safetensors", tmp_path / "input", tmp_path / "x")
    other = build_model(len(tok), size={"hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                                        "num_key_value_heads": 1, "head_dim": 24, "intermediate_size": 64})
    save_model(other, tok, tmp_path / "other")
    with pytest.raises(ValueError, match="does not fit the model of"):
        export_checkpoint(ckpt, tmp_path / "other", tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
