"""Tokenizer: SID tokens are single ids, chat template is exact, save/load is lossless."""

import random

import pytest

from reranker.text.sid import format_sid, sid_token_vocabulary
from reranker.text.tokenizer import CHAT_TEMPLATE, IM_END, MASK_TOKEN, PAD_TOKEN, build_tokenizer, load_tokenizer


def corpus(n=120, seed=0):
    rng = random.Random(seed)
    words = ["lipstick", "shampoo", "matte", "brand", "category", "history", "co-bought", "candidate", "ranks"]
    out = []
    for _ in range(n):
        sid = format_sid([rng.randrange(256) for _ in range(4)])
        out.append(f"{' '.join(rng.choices(words, k=8))} {sid} bought 12/0/3; category yes\n")
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(corpus(), vocab_size=600)


def test_every_sid_and_control_token_is_one_id(tok):
    vocab = sid_token_vocabulary() + ["<|mask|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
    encoded = tok(vocab, add_special_tokens=False)["input_ids"]
    assert all(len(ids) == 1 for ids in encoded), [t for t, ids in zip(vocab, encoded) if len(ids) != 1][:5]
    assert len({ids[0] for ids in encoded}) == len(vocab)


def test_sid_strings_round_trip(tok):
    rng = random.Random(1)
    for _ in range(50):
        sid = format_sid([rng.randrange(256) for _ in range(4)])
        ids = tok.encode(sid, add_special_tokens=False)
        assert len(ids) == 6
        assert tok.decode(ids) == sid
        text = f'1.{sid} Lipstick, Acme; {{"ranking": ["{sid}"]}}'
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_skip_special_tokens_keeps_sids_and_think_markers(tok):
    sid = format_sid((97, 168, 137, 135))
    text = f"<think>\nok\n</think>\n{sid}<|im_end|><|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == f"<think>\nok\n</think>\n{sid}"


def test_special_token_roles(tok):
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN and tok.mask_token == MASK_TOKEN
    assert len({tok.eos_token_id, tok.pad_token_id, tok.mask_token_id}) == 3
    assert tok.bos_token is None
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)


def test_chat_template_exact(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U <a_1>"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU <a_1><|im_end|>\n<|im_start|>assistant\n"
    )
    full = messages + [{"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(full, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU <a_1><|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    )
    with pytest.raises(Exception, match="unsupported chat role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_save_load_identical(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    texts = corpus(10, seed=5) + ["<think>\nx\n</think>\n{\"ranking\": []}<|im_end|>", "<|mask|><|mask|>"]
    assert len(loaded) == len(tok)
    assert [loaded.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    messages = [{"role": "user", "content": texts[0]}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.mask_token_id) == \
        (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id)


def test_training_is_deterministic():
    a = build_tokenizer(corpus(40), vocab_size=400)
    b = build_tokenizer(corpus(40), vocab_size=400)
    assert a.get_vocab() == b.get_vocab()


def test_bad_inputs():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(["x"], vocab_size=100)
    with pytest.raises(TypeError, match="strings"):
        build_tokenizer(["ok", 3], vocab_size=300)
