"""The project's Hugging Face tokenizer: byte-level BPE plus SID and chat tokens.

The BPE is trained on the re-ranking corpus itself (prompts and traces), so a few
thousand merges cover it; every SID code, the SID brackets, the chat markers, the
reasoning markers and the diffusion mask are added tokens, so each is exactly one id
and the BPE never splits or learns them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from reranker.text.sid import SID_CODEBOOK, sid_token_vocabulary

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Control tokens: special=True, so decode(skip_special_tokens=True) drops them.
CONTROL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]
# Content tokens: single ids, but kept by skip_special_tokens=True because the parser needs
# the reasoning markers and the SIDs in the decoded text (as Qwen3 treats <think>).
CONTENT_TOKENS = [THINK_OPEN, THINK_CLOSE] + sid_token_vocabulary(SID_CODEBOOK)

# ChatML as in Qwen: each message is "<|im_start|>{role}\n{content}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported chat role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_ADDED_RE = re.compile("|".join(re.escape(t) for t in sorted(CONTROL_TOKENS + CONTENT_TOKENS, key=len, reverse=True)))


def _strip_added_tokens(texts: Iterable[str]) -> Iterable[str]:
    """Training text without added tokens: they get their own ids, so BPE merges on them are waste."""
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"tokenizer corpus must hold strings, got {type(text).__name__}: {text!r:.80}")
        yield _ADDED_RE.sub(" ", text)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 2000, min_frequency: int = 2):
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer.

    ``vocab_size`` bounds the learned BPE vocabulary (256 byte symbols + merges); the
    added tokens (4 x 256 SID codes, SID brackets, chat/think/mask tokens) come on top,
    with ids after the BPE vocabulary. A small corpus may stop short of ``vocab_size``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols, got {vocab_size}")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_strip_added_tokens(texts), trainer=trainer)
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in CONTENT_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    return tok


def load_tokenizer(path):
    """Load a tokenizer saved with ``save_pretrained`` (ours or a real checkpoint's); local files only,
    so a missing directory is never looked up on the Hugging Face hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
