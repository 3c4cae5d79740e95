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

from reranker.text.sid import SID_RE
from reranker.text.tokenizer import IM_END, load_tokenizer, THINK_CLOSE
from reranker.training.batches import collate, encode_examples, read_jsonl

_LEVEL = re.compile(r"^<([a-z])_\d+>$")


def token_levels(tokenizer) -> dict[int, str]:
    """token id -> SID level letter ("a", "b", ...) for every SID code token."""
    out = {}
    for tok, i in tokenizer.get_vocab().items():
        m = _LEVEL.match(tok)
        if m:
            out[int(i)] = m.group(1)
    return out


def _answer_sids(ids: list[int], levels: dict[int, str]) -> list[tuple[int, ...]]:
    """The SIDs (tuples of code-token ids) written in a token sequence, in order."""
    out, cur = [], []
    for t in ids:
        if t in levels:
            if levels[t] == "a" and cur:
                out.append(tuple(cur))
                cur = []
            cur.append(t)
        elif cur:
            out.append(tuple(cur))
            cur = []
    return out + ([tuple(cur)] if cur else [])


@torch.no_grad()
def sid_copy_accuracy(model, tokenizer, records: list[dict], batch_size: int = 8, max_len: int = 1024) -> dict:
    """Teacher-forced argmax accuracy of the answer tokens of `records` (prompt_messages + assistant):

    * "by_level": per SID level (a, b, c, d) and "other" (JSON and end tokens);
    * "by_prefix": the same per level, split by whether the SID's earlier levels (the prefix already
      written) are shared with another SID of the answer ("shared": copying needs to know which
      candidate it is on) or not ("unique": a plain content match finds the source);
    * "reasoning_by_level": the same per level for SID codes the reasoning writes before the answer
      (a scan trace's decision, "#6.<sid> first": a lookup by candidate number, where the answer's
      later SIDs are copies of what came before);
    * "errors": each wrong SID-token prediction, by where the predicted token comes from:
      "other_candidate" (a code of another SID of the answer, i.e. the lookup hit the wrong
      candidate), "context" (elsewhere before the answer: prompt or reasoning, e.g. a history item) or "invented".
    The answer's SIDs are the candidates (a valid answer is a permutation of them)."""
    levels = token_levels(tokenizer)
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded, _ = encode_examples(tokenizer, records, max_len)
    hits: dict[str, int] = {}
    counts: dict[str, int] = {}
    split: dict[str, list[int]] = {}  # "b/shared" -> [hits, count]
    errors = {"other_candidate": 0, "context": 0, "invented": 0}
    thought: dict[str, list[int]] = {}  # SID codes written in the reasoning (a scan's decision): level -> [hits, count]
    for s in range(0, len(encoded), batch_size):
        b = collate(encoded[s:s + batch_size], pad)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"], use_cache=False).logits
        pred, target = logits[:, :-1].argmax(-1), b["labels"][:, 1:]
        supervised, answer = target >= 0, b["answer_mask"][:, 1:]
        keep = answer & supervised
        in_reasoning = ~answer & supervised
        for p, t in zip(pred[in_reasoning].tolist(), target[in_reasoning].tolist()):
            if t in levels:
                h_c = thought.setdefault(levels[t], [0, 0])
                h_c[0] += int(p == t)
                h_c[1] += 1
        for r in range(pred.shape[0]):
            row_keep = keep[r]
            answer_ids = target[r][row_keep].tolist()
            sids = _answer_sids(answer_ids, levels)
            cand_tokens = {t for sid in sids for t in sid}
            context_tokens = set(b["input_ids"][r][b["attention_mask"][r].bool() & ~b["answer_mask"][r]].tolist())
            prefix: list[int] = []
            for p, t in zip(pred[r][row_keep].tolist(), answer_ids):
                lvl = levels.get(t, "other")
                counts[lvl] = counts.get(lvl, 0) + 1
                hits[lvl] = hits.get(lvl, 0) + int(p == t)
                if lvl == "other":
                    prefix = []
                    continue
                if lvl == "a":
                    prefix = []
                n_match = sum(1 for sid in sids if list(sid[:len(prefix)]) == prefix)
                key = f"{lvl}/{'shared' if n_match > 1 else 'unique'}"
                h_c = split.setdefault(key, [0, 0])
                h_c[0] += int(p == t)
                h_c[1] += 1
                if p != t:
                    kind = "other_candidate" if p in cand_tokens else "context" if p in context_tokens else "invented"
                    errors[kind] += 1
                prefix.append(t)
    by_prefix: dict[str, dict] = {}
    for key in sorted(split):
        lvl, kind = key.split("/")
        by_prefix.setdefault(lvl, {})[kind] = {"accuracy": split[key][0] / split[key][1], "tokens": split[key][1]}
    return {"by_level": {k: hits[k] / counts[k] for k in sorted(counts)}, "tokens": dict(sorted(counts.items())),
            "by_prefix": by_prefix, "errors": errors, "examples": len(encoded),
            "reasoning_by_level": {k: {"accuracy": h / n, "tokens": n} for k, (h, n) in sorted(thought.items())}}


def reference_ranking(record: dict) -> list[str]:
    """The SIDs of a record's reference answer (after </think>), in order: the candidates."""
    return [m.group(0) for m in SID_RE.finditer(record["assistant"].split(THINK_CLOSE, 1)[-1])]


@torch.no_grad()
def greedy_copy_validity(model, tokenizer, records: list[dict], max_new_tokens: int = 320,
                         batch_size: int = 8, max_len: int = 1024) -> dict:
    """Greedy AR decoding of each record's prompt, parsed against the SIDs of its reference answer:
    {"examples", "valid_rate", "exact_rate" (the reference answer's order), "failures": {kind: n}}.
    On copy tasks (every answer token determined by the prompt) this is the valid-output rate the
    model would reach on re-ranking if choosing were free: an upper bound to check before SFT."""
    from reranker.diffusion.ar_decoder import ar_decode
    from reranker.text.answer import parse_ranking

    eos = tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    model.eval()
    valid = exact = 0
    failures: dict[str, int] = {}
    for s in range(0, len(records), batch_size):
        chunk = records[s:s + batch_size]
        encoded, _ = encode_examples(tokenizer, chunk, max_len)  # the prompts exactly as in training
        prompts = [e.input_ids[:e.n_prompt] for e in encoded]
        out = ar_decode(model, prompts, max_new_tokens, eos, pad)
        for r, toks in zip(chunk, out.tokens):
            text = tokenizer.decode(toks, skip_special_tokens=False).split(IM_END, 1)[0]
            ref = reference_ranking(r)
            parsed = parse_ranking(text, ref)
            if parsed.ok:
                valid += 1
                exact += list(parsed.permutation) == list(range(len(ref)))
            else:
                failures[parsed.failure] = failures.get(parsed.failure, 0) + 1
    n = max(len(records), 1)
    return {"examples": len(records), "valid_rate": valid / n, "exact_rate": exact / n,
            "failures": dict(sorted(failures.items()))}


def run_sid_copy(model_dir, data_dir, file: str = "valid.jsonl", limit: int | None = 64, batch_size: int = 8,
                 greedy: bool = False) -> dict:
    from reranker.model import load_model

    path = Path(data_dir) / file
    model = load_model(model_dir)  # first: it names a missing or damaged model dir
    tok = load_tokenizer(model_dir)
    records = read_jsonl(path, limit)
    res = sid_copy_accuracy(model, tok, records, batch_size)
    if greedy:
        res["greedy"] = greedy_copy_validity(model, tok, records, batch_size=batch_size)
    return {"model": str(model_dir), "file": str(path), **res}
