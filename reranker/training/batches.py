"""Examples JSONL -> token ids with per-token supervision -> padded training tensors.

A record is {"prompt_messages": [{"role": "system", ...}, {"role": "user", ...}],
"assistant": "<think>\\n...\\n</think>\\n{\"ranking\": [...]}"} (other fields are ignored).
The sequence is prompt (chat template with the assistant header) + assistant text + <|im_end|>;
only the response is supervised, each token tagged "reasoning" or "answer" so the loss can
weight them by λ_r and λ_o.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from candidate_gen.files import read_jsonl as _read_jsonl

IM_END = "<|im_end|>"
THINK_CLOSE = "</think>"
IGNORE = -100  # labels value that no loss looks at (the HF convention)


def read_jsonl(path, limit: int | None = None) -> list[dict]:
    """Training records (they need 'prompt_messages' and 'assistant'); errors name the file and line."""
    return _read_jsonl(path, {"prompt_messages": list, "assistant": str}, limit)


def read_train_records(data_dir: Path, train_file, limit: int | None = None) -> list[dict]:
    """The records of ``train_file`` (one path or a list of paths, each relative to ``data_dir``)
    in file order; ``limit`` caps the pooled count."""
    files = [train_file] if isinstance(train_file, (str, Path)) else list(train_file or [])
    if not files:
        raise ValueError("train_file: give a file or a non-empty list of files")
    records: list[dict] = []
    for f in files:
        if not isinstance(f, (str, Path)):
            raise ValueError(f"train_file: expected file paths, got {f!r}")
        path = Path(data_dir) / f  # an absolute f stays itself
        if not path.is_file():
            raise FileNotFoundError(f"train_file {str(f)!r}: {path} not found (relative train_file paths are "
                                    f"read from the data directory {data_dir}; give an absolute path for a "
                                    "file elsewhere)")
        records += read_jsonl(path)
    return records[:limit] if limit is not None else records


def _ids(encoded) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x
    returned a plain list. Accept both."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):  # a batch of one
        encoded = encoded[0]
    return [int(i) for i in encoded]


def end_of_turn(tokenizer) -> str:
    """ChatML's end-of-turn marker if the tokenizer knows it (ours and Qwen's), else its EOS."""
    vocab = tokenizer.get_vocab()
    if IM_END in vocab:
        return IM_END
    if tokenizer.eos_token is None:
        raise ValueError("tokenizer has neither <|im_end|> nor an eos token to end the response")
    return tokenizer.eos_token


def token_ids(tokenizer) -> tuple[int, int]:
    """(eos, pad): EOS is the response's end-of-turn token (what the decoders stop at); pad falls
    back to it."""
    eos = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def _local_token_types(tokenizer, text: str) -> list[str]:
    """Same rule as reranker.text.prompt.response_token_types: from the first </think> on, answer."""
    close = text.find(THINK_CLOSE)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if close < 0:
        return ["answer"] * len(enc["input_ids"])
    return ["answer" if end > close else "reasoning" for _, end in enc["offset_mapping"]]


def token_types(tokenizer, text: str) -> list[str]:
    try:
        from reranker.text.prompt import response_token_types
    except ImportError:
        return _local_token_types(tokenizer, text)
    return response_token_types(tokenizer, text)


@dataclass
class Encoded:
    input_ids: list[int]
    n_prompt: int  # leading tokens that are not supervised
    n_reasoning: int  # supervised reasoning tokens (they come first in the response)
    n_answer: int
    prompt_truncated: int = 0  # prompt tokens dropped from the left
    response_truncated: int = 0  # response tokens dropped from the right

    @property
    def n_supervised(self) -> int:
        return self.n_reasoning + self.n_answer


def encode_example(tokenizer, record: dict, max_len: int, end_token: str | None = None) -> Encoded:
    """Tokenize one record. Over `max_len`, the prompt loses tokens from the left (the newest
    history and the candidates sit at its end); a response longer than max_len - 1 alone is
    cut from the right (rare; counted)."""
    prompt = _ids(tokenizer.apply_chat_template(record["prompt_messages"], add_generation_prompt=True, tokenize=True))
    text = record["assistant"] + (end_token or end_of_turn(tokenizer))
    response = _ids(tokenizer(text, add_special_tokens=False)["input_ids"])
    types = token_types(tokenizer, text)
    if len(types) != len(response):
        raise ValueError(f"token types ({len(types)}) and response ids ({len(response)}) disagree")
    if "answer" in types and "reasoning" in types[types.index("answer"):]:
        raise ValueError("reasoning tokens after the answer started")
    response_cut = max(0, len(response) - (max_len - 1))
    if response_cut:
        response, types = response[:len(response) - response_cut], types[:len(types) - response_cut]
    prompt_cut = max(0, len(prompt) + len(response) - max_len)
    prompt = prompt[prompt_cut:]
    n_reasoning = sum(t == "reasoning" for t in types)
    return Encoded(prompt + response, len(prompt), n_reasoning, len(response) - n_reasoning, prompt_cut, response_cut)


def encode_examples(tokenizer, records: list[dict], max_len: int) -> tuple[list[Encoded], dict]:
    end = end_of_turn(tokenizer)
    out = [encode_example(tokenizer, r, max_len, end) for r in records]
    stats = {
        "examples": len(out),
        "prompt_truncated_examples": sum(e.prompt_truncated > 0 for e in out),
        "response_truncated_examples": sum(e.response_truncated > 0 for e in out),
        "mean_tokens": sum(len(e.input_ids) for e in out) / max(1, len(out)),
        "supervised_tokens": sum(e.n_supervised for e in out),
    }
    return out, stats


def collate(examples: list[Encoded], pad_id: int, lambda_r: float = 1.0, lambda_o: float = 1.0) -> dict:
    """Right-padded tensors [B, T]: input_ids, attention_mask, position_ids, labels (IGNORE on
    prompt and padding), loss_weights (λ_r on reasoning, λ_o on answer, 0 elsewhere) and
    answer_mask (answer tokens, for reporting the answer-only NLL). labels/weights are aligned
    with input_ids (HF convention): the loss shifts them."""
    T = max(len(e.input_ids) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    weights = torch.zeros((B, T), dtype=torch.float32)
    answer = torch.zeros((B, T), dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        input_ids[i, :n] = ids
        attention_mask[i, :n] = 1
        labels[i, e.n_prompt:n] = ids[e.n_prompt:]
        r_end = e.n_prompt + e.n_reasoning
        weights[i, e.n_prompt:r_end] = lambda_r
        weights[i, r_end:n] = lambda_o
        answer[i, r_end:n] = True
    position_ids = torch.arange(T).unsqueeze(0).expand(B, T).contiguous()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "labels": labels, "loss_weights": weights, "answer_mask": answer}


def weighted_nll(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                 answer_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Σ_t w_t · (−log p(label_t)) over supervised tokens, with the AR shift (position t−1
    predicts token t). Returns that weighted sum (with its graph) and detached sums for
    reporting: supervised tokens, unweighted NLL, and answer-only NLL and tokens. The caller
    divides by the supervised-token count of the whole global batch."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != IGNORE
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.clamp_min(0).reshape(-1), reduction="none"
    ).view_as(target) * mask
    loss_sum = (nll * weights[:, 1:].to(nll.dtype)).sum()
    with torch.no_grad():
        stats = {"tokens": float(mask.sum()), "nll_sum": float(nll.sum())}
        if answer_mask is not None:
            a = answer_mask[:, 1:] & mask
            stats["answer_tokens"] = float(a.sum())
            stats["answer_nll_sum"] = float((nll * a).sum())
    return loss_sum, stats
