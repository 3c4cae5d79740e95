"""Model build / save / load / resize."""
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from reranker.diffusion.convert import convert_to_diffusion, load_diffusion_config
from reranker.model import (SIZES, average_models, build_model, load_model, no_weight_bars, resize_for_tokenizer,
                            save_model)

torch.set_num_threads(1)


def tiny_tokenizer(words=("a", "b", "c", "d")):
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<bos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def test_build_is_seeded_and_sized():
    a = build_model(20, "tiny", pad_token_id=0, eos_token_id=1, seed=3)
    b = build_model(20, "tiny", pad_token_id=0, eos_token_id=1, seed=3)
    c = build_model(20, "tiny", pad_token_id=0, eos_token_id=1, seed=4)
    sa, sc = a.state_dict(), c.state_dict()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in sa.items())
    assert not all(torch.equal(v, sc[k]) for k, v in sa.items())
    assert a.config.hidden_size == 32 and a.config.num_hidden_layers == 2 and a.config.tie_word_embeddings
    d = build_model(20, dict(SIZES["tiny"], num_hidden_layers=1))
    assert d.config.num_hidden_layers == 1


def test_save_load_roundtrip(tmp_path):
    tok = tiny_tokenizer()
    model = build_model(len(tok), "tiny", pad_token_id=0, eos_token_id=1, bos_token_id=2).eval()
    out = tmp_path / "m"
    save_model(model, tok, out)
    save_model(model, tok, out)  # overwrite in place: still one clean directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    loaded = load_model(out).eval()
    x = torch.tensor([[3, 4, 5, 1]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, loaded(x).logits, atol=0, rtol=0)
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("damage", ["garbage", "cut short", "empty"])
def test_a_damaged_weight_file_is_one_line_naming_it(tmp_path, damage, capsys):
    """It used to be a 29-line traceback through transformers that never named the file."""
    import re

    from integration.cli import main
    from reranker.model import ModelDirError

    tok = tiny_tokenizer()
    out = save_model(build_model(len(tok), "tiny", pad_token_id=0, eos_token_id=1), tok, tmp_path / "m")
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": b"not weights " * 50, "cut short": data[:-100], "empty": b""}[damage])
    with pytest.raises(ModelDirError, match=rf"^{re.escape(str(weights))}: not a readable safetensors file \("):
        load_model(out)
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dgr2 convert: error: {weights}: ") and err.count("\n") == 1, err


def test_a_directory_without_config_is_named(tmp_path):
    from reranker.model import ModelDirError

    (tmp_path / "m").mkdir()
    with pytest.raises(ModelDirError, match=r"m: not a model directory \(no config.json\)"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("command", ["convert", "sid-copy"])
def test_a_missing_model_directory_is_one_line_naming_it(tmp_path, command, capsys):
    """It used to be a traceback from the Hugging Face hub client about repo ids."""
    from integration.cli import main
    from reranker.model import ModelDirError

    missing = tmp_path / "no" / "such-model"
    for path in (missing, "models/no-such-model"):
        with pytest.raises(ModelDirError, match=r"no such model directory"):
            load_model(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match=r"file: not a model directory \(a file\)"):
        load_model(tmp_path / "file")
    argv = {"convert": ["convert", "--from", str(missing), "--to", str(tmp_path / "d")],
            "sid-copy": ["sid-copy", "--model", str(missing), "--data", str(tmp_path)]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"dgr2 {command}: error: {missing}: no such model directory "
                   "(nor a model in the local Hugging Face cache)\n")


def test_resize_for_tokenizer():
    tok = tiny_tokenizer()
    model = build_model(len(tok), "tiny")
    before = model.get_input_embeddings().weight.detach().clone()
    tok.add_special_tokens({"mask_token": "<|mask|>"})
    resize_for_tokenizer(model, tok)
    after = model.get_input_embeddings().weight
    assert after.shape[0] == len(tok) == before.shape[0] + 1
    assert torch.equal(after[:-1], before)
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    resize_for_tokenizer(model, tiny_tokenizer())  # never shrinks
    assert model.get_input_embeddings().weight.shape[0] == len(tok)


def test_convert_to_diffusion(tmp_path):
    tok = tiny_tokenizer()
    ar = build_model(len(tok), "tiny", pad_token_id=0, eos_token_id=1, bos_token_id=2)
    save_model(ar, tok, tmp_path / "ar")
    model, new_tok = convert_to_diffusion(tmp_path / "ar", tmp_path / "dlm", block_size=4)
    loaded = load_model(tmp_path / "dlm")
    info = load_diffusion_config(loaded)
    saved_tok = AutoTokenizer.from_pretrained(str(tmp_path / "dlm"), local_files_only=True)
    mask_id = saved_tok.convert_tokens_to_ids("<|mask|>")
    assert info == {"block_size": 4, "mask_token_id": mask_id, "mask_token": "<|mask|>", "ar_token_shift": True}
    assert mask_id == len(tok) and loaded.get_input_embeddings().weight.shape[0] == len(tok) + 1
    old, new = ar.state_dict(), loaded.state_dict()
    for k, v in old.items():  # every AR weight copied one to one (embeddings: the old rows)
        torch.testing.assert_close(new[k][:v.shape[0]], v, atol=0, rtol=0)
    assert load_diffusion_config(ar) is None
    # converting again (mask token present): no new token, no resize, same id
    convert_to_diffusion(tmp_path / "dlm", tmp_path / "dlm2", block_size=8)
    again = load_model(tmp_path / "dlm2")
    assert load_diffusion_config(again)["mask_token_id"] == mask_id
    assert load_diffusion_config(again)["block_size"] == 8
    assert again.get_input_embeddings().weight.shape[0] == len(tok) + 1


def test_convert_keeps_an_existing_mask_role(tmp_path):
    tok = tiny_tokenizer()
    tok.add_special_tokens({"mask_token": "[MASK]"})
    save_model(build_model(len(tok), "tiny"), tok, tmp_path / "ar")
    _, new_tok = convert_to_diffusion(tmp_path / "ar", tmp_path / "dlm", block_size=2)
    assert new_tok.mask_token == "[MASK]" and len(new_tok) == len(tok) + 1
    assert new_tok("a <|mask|>").input_ids == [3, len(tok)]
    assert load_diffusion_config(load_model(tmp_path / "dlm"))["mask_token_id"] == len(tok)


def test_average_models_is_the_elementwise_mean_and_checks_shapes(tmp_path):
    tok = tiny_tokenizer()
    dirs = []
    for seed in (1, 2, 3):
        m = build_model(len(tok), "tiny", pad_token_id=0, eos_token_id=1, seed=seed)
        dirs.append(save_model(m, tok, tmp_path / f"m{seed}"))
    out = average_models(dirs, tmp_path / "avg")
    got = load_model(out).state_dict()
    parts = [load_model(d).state_dict() for d in dirs]
    for k, v in got.items():
        torch.testing.assert_close(v, sum(p[k] for p in parts) / 3, atol=1e-6, rtol=0)
    assert (out / "tokenizer.json").exists()
    other = save_model(build_model(len(tok), dict(SIZES["tiny"], num_hidden_layers=1), pad_token_id=0,
                                   eos_token_id=1), tok, tmp_path / "other")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        average_models([dirs[0], other], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="at least two"):
        average_models(dirs[:1], tmp_path / "bad")


def test_save_and_load_draw_no_transformers_bars(tmp_path, capfd):
    """transformers draws "Writing model shards" / "Loading weights" bars on stderr for every
    save_pretrained / from_pretrained; ours are silent, and its bars elsewhere are not."""
    from transformers.utils import logging as hf_logging

    save_model(build_model(40, "tiny"), tiny_tokenizer(), tmp_path / "m")
    load_model(tmp_path / "m")
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err
    assert hf_logging.is_progress_bar_enabled()  # the global switch is not touched
    list(hf_logging.tqdm(range(2), desc="a bar outside"))
    assert "a bar outside" in capfd.readouterr().err


def test_no_weight_bars_restores_the_previous_hook():
    from transformers.utils import logging as hf_logging

    seen = []

    def record(factory, args, kwargs):
        seen.append(kwargs["desc"])
        return factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(record)
    try:
        with no_weight_bars():
            list(hf_logging.tqdm(range(2), desc="inside"))
        list(hf_logging.tqdm(range(2), desc="after"))
    finally:
        hf_logging.set_tqdm_hook(previous)
    assert seen == ["after"]
