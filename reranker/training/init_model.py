"""The starting point of training: a fresh small Qwen3, or any local HF causal LM, plus our tokens.

Fresh (default): a Qwen3-architecture model sized by `size` ("cpu" ≈ 4M parameters) over the
tokenizer that `dgr2 data build` trained on the re-ranking corpus.

From a local checkpoint (`base=DIR`, e.g. a Qwen3 directory): its own tokenizer is kept and
extended with the SID, reasoning and mask tokens (each one id, never split), the embedding matrix
grows to match, and the ChatML chat template is set if the tokenizer has none. Nothing is
downloaded: the directory must already hold the weights.
"""
from __future__ import annotations

from pathlib import Path

from reranker.model import (DEFAULT_QK_NORM_GAIN, build_model, check_qk_norm_gain, load_model, resize_for_tokenizer,
                            save_model)
from reranker.text.tokenizer import CHAT_TEMPLATE, CONTENT_TOKENS, CONTROL_TOKENS, IM_END, load_tokenizer, PAD_TOKEN


def extend_tokenizer(tok):
    """Add our control and content tokens to a foreign tokenizer (idempotent)."""
    vocab = tok.get_vocab()
    control = [t for t in CONTROL_TOKENS if t not in vocab]
    content = [t for t in CONTENT_TOKENS if t not in vocab]
    if control:
        tok.add_tokens(control, special_tokens=True)
    if content:
        tok.add_tokens(content, special_tokens=False)
    if tok.pad_token is None:
        tok.pad_token = PAD_TOKEN
    tok.eos_token = IM_END
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    return tok


def init_model(data_dir, out_dir, size: str | dict = "cpu", base: str | None = None, seed: int = 0,
               qk_norm_gain: float | None = None) -> Path:
    """qk_norm_gain: the fresh model's initial query/key norm gains (`build_model`; None: its
    default); a base checkpoint keeps its own, so it cannot be combined with one."""
    qk_norm_gain = check_qk_norm_gain(DEFAULT_QK_NORM_GAIN if qk_norm_gain is None else qk_norm_gain, base)
    if base:
        if not Path(base).is_dir():
            raise FileNotFoundError(f"--base {base}: not a local model directory (nothing is downloaded)")
        tok = extend_tokenizer(load_tokenizer(base))
        model = resize_for_tokenizer(load_model(base), tok)
        model.config.eos_token_id = tok.convert_tokens_to_ids(IM_END)
        model.config.pad_token_id = tok.pad_token_id
    else:
        tok_dir = Path(data_dir) / "tokenizer"
        if not tok_dir.is_dir():
            raise FileNotFoundError(f"{tok_dir}: missing; build the re-ranking data with `dgr2 data build`")
        tok = load_tokenizer(tok_dir)
        model = build_model(len(tok), size, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.convert_tokens_to_ids(IM_END), seed=seed, qk_norm_gain=qk_norm_gain)
    return save_model(model, tok, out_dir)
