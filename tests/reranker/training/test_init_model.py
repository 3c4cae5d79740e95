"""Model initialisation: fresh from the data's tokenizer, or a local HF checkpoint extended with our tokens."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reranker.model import build_model, save_model
from reranker.text.tokenizer import build_tokenizer
from reranker.training.init_model import init_model


def test_fresh_and_local_checkpoint(tmp_path):
    tok = build_tokenizer(["History Candidates cobought brand category"] * 3, vocab_size=300)
    data = tmp_path / "data"
    tok.save_pretrained(str(data / "tokenizer"))
    fresh = init_model(data, tmp_path / "fresh", size="tiny")
    m = AutoModelForCausalLM.from_pretrained(str(fresh), local_files_only=True)
    assert m.get_input_embeddings().weight.shape[0] == len(tok)

    # A "foreign" local checkpoint: a tiny random Qwen3 with a tokenizer lacking our SID tokens.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    foreign_tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    foreign = build_model(3, size="tiny")
    save_model(foreign, foreign_tok, tmp_path / "foreign")
    out = init_model(None, tmp_path / "ext", base=str(tmp_path / "foreign"))
    t2 = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    m2 = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert len(t2("<a_7><d_255>", add_special_tokens=False)["input_ids"]) == 2
    assert m2.get_input_embeddings().weight.shape[0] >= len(t2)
    # The original rows are untouched.
    assert torch.equal(m2.get_input_embeddings().weight[:3], foreign.get_input_embeddings().weight[:3])
    assert t2.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>user")


def test_qk_norm_gain_sets_every_query_and_key_gain_and_nothing_else(tmp_path):
    import pytest

    from integration.phases import check_model_section

    plain, gained = build_model(50, size="tiny", seed=3), build_model(50, size="tiny", seed=3, qk_norm_gain=1.5)
    a, b = plain.state_dict(), gained.state_dict()
    for name in a:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.all(a[name] == 1.0) and torch.all(b[name] == 1.5), name
        else:
            assert torch.equal(a[name], b[name]), name  # the same seed draws the same weights
    for bad in (0, -1.0, 9, True, "2"):
        with pytest.raises(ValueError, match="qk_norm_gain"):
            build_model(50, size="tiny", qk_norm_gain=bad)
    with pytest.raises(ValueError, match="model.qk_norm_gain"):
        check_model_section({"size": "cpu", "qk_norm_gain": 0})
    with pytest.raises(ValueError, match="base checkpoint"):
        check_model_section({"base": "some/dir", "qk_norm_gain": 1.5})
    with pytest.raises(ValueError, match="unknown key"):
        check_model_section({"qk_gain": 1.5})
    check_model_section({"size": "cpu", "qk_norm_gain": 1.5})
