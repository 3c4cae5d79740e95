"""Can the model copy semantic IDs? Teacher-forced accuracy of the answer's SID tokens, by level.

A ranking answer is ten SIDs, each `<|sid_begin|><a_i><b_j><c_k><d_l><|sid_end|>`, copied out of
the prompt. With the reference answer fed in (teacher forcing), a model that copies predicts
<b_j> from the <a_i> before it almost always (few candidates share a first level); a model that
does not copy guesses from the marginal statistics. Accuracy per level (a, b, c, d, and every
other answer token) tells the two apart long before greedy decoding produces a valid ranking,
which is why it is the diagnostic for the "0% valid" failure.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from .training.batches import collate, encode_examples, read_jsonl

_LEVEL = re.compile(r"^<([a-z])_\d+>$")


def token_levels(tokenizer) -> dict[int, str]:
    """token id -> SID level letter ("a", "b", ...) for every SID code token."""
    out = {}
    for tok, i in tokenizer.get_vocab().items():
        m = _LEVEL.match(tok)
        if m:
            out[int(i)] = m.group(1)
    return out


@torch.no_grad()
def sid_copy_accuracy(model, tokenizer, records: list[dict], batch_size: int = 8, max_len: int = 1024) -> dict:
    """{"by_level": {level: accuracy}, "tokens": {level: count}, "examples": n} over the answer
    tokens of `records` (prompt_messages + assistant), argmax against the reference."""
    levels = token_levels(tokenizer)
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded, _ = encode_examples(tokenizer, records, max_len)
    hits: dict[str, int] = {}
    counts: dict[str, int] = {}
    for s in range(0, len(encoded), batch_size):
        b = collate(encoded[s:s + batch_size], pad)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"], use_cache=False).logits
        pred, target = logits[:, :-1].argmax(-1), b["labels"][:, 1:]
        keep = b["answer_mask"][:, 1:] & (target >= 0)
        for p, t in zip(pred[keep].tolist(), target[keep].tolist()):
            lvl = levels.get(t, "other")
            counts[lvl] = counts.get(lvl, 0) + 1
            hits[lvl] = hits.get(lvl, 0) + int(p == t)
    return {"by_level": {k: hits[k] / counts[k] for k in sorted(counts)}, "tokens": dict(sorted(counts.items())),
            "examples": len(encoded)}


def run_sid_copy(model_dir, data_dir, file: str = "valid.jsonl", limit: int | None = 64, batch_size: int = 8) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(data_dir) / file
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    res = sid_copy_accuracy(model, tok, read_jsonl(path, limit), batch_size)
    return {"model": str(model_dir), "file": str(path), **res}
