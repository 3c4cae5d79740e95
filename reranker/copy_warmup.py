"""Copy warm-up data: teach a freshly initialised LM to copy semantic IDs before it learns to rank.

Why: the answer is a JSON list of candidate SIDs, four tokens each, that must be copied out of the
prompt. A small randomly initialised model trained only on the re-ranking task did not learn to
copy (measured on Beauty: after 666 SFT steps it chose the right second SID token given the first
only ~50% of the time, teacher forced, and greedy decoding gave 0% valid rankings: repeated or
invented SIDs). Copying needs induction-style attention, which the ranking loss alone teaches
slowly because most of it is spent on other tokens.

Each warm-up example is short: the candidate SIDs of a training list in a shuffled order, the
instruction "put #k first, then the rest in retriever order", and the answer in exactly the
re-ranking format (a one-sentence <think> block, then {"ranking": [...]}). Every answer token is
determined by the prompt, so the only way to lower the loss is to copy. Nothing here looks at
targets: k is drawn at random.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from candidate_gen.atomic import atomic_write_text, read_jsonl

SYSTEM = "Copy the candidates."


def copy_example(sids: list[str], k: int) -> dict:
    """One warm-up record (prompt_messages + assistant) for candidate SIDs `sids` and promoted index k."""
    if not 0 <= k < len(sids):
        raise ValueError(f"promoted index {k} outside 0..{len(sids) - 1}")
    lines = "\n".join(f"{i + 1}.{s}" for i, s in enumerate(sids))
    order = [sids[k]] + [s for i, s in enumerate(sids) if i != k]
    user = f"Candidates (retriever order).\n{lines}\nPut #{k + 1} first, then the rest in retriever order."
    think = f"<think>\n{sids[k]} (#{k + 1}) first, then the rest in retriever order.\n</think>\n"
    return {"prompt_messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "assistant": think + json.dumps({"ranking": order}, ensure_ascii=False)}


def full_prompt_copy_example(record: dict, k: int) -> dict:
    """The same copy task inside a real re-ranking prompt (history SIDs and evidence lines included,
    the distractors a short prompt lacks): its last line asks for #k first, then the rest in order."""
    sids = [str(s) for s in record["candidate_sids"]]
    if not 0 <= k < len(sids):
        raise ValueError(f"promoted index {k} outside 0..{len(sids) - 1}")
    messages = [dict(m) for m in record["prompt_messages"]]
    body = messages[-1]["content"].rstrip("\n").rsplit("\n", 1)[0]  # drop the "Rank all N candidates." line
    messages[-1]["content"] = f"{body}\nPut #{k + 1} first, then the rest in retriever order."
    order = [sids[k]] + [s for i, s in enumerate(sids) if i != k]
    think = f"<think>\n{sids[k]} (#{k + 1}) first, then the rest in retriever order.\n</think>\n"
    return {"prompt_messages": messages, "assistant": think + json.dumps({"ranking": order}, ensure_ascii=False)}


def build_copy_warmup(data_dir, out_name: str = "copy_warmup.jsonl", seed: int = 0, limit: int | None = None,
                      source: str = "train.jsonl", full_prompt: bool = False) -> Path:
    """Write <data_dir>/<out_name>: one warm-up example per list of <data_dir>/<source>
    (train.jsonl for training; valid.jsonl gives held-out examples for the SID-copy diagnostic).
    full_prompt: keep the list's real prompt (retriever order, history and evidence) instead of a
    short shuffled list of SIDs."""
    data_dir = Path(data_dir)
    required = {"candidate_sids": list, "prompt_messages": list} if full_prompt else {"candidate_sids": list}
    rows = read_jsonl(data_dir / source, required, limit)
    rng = random.Random(seed)
    lines = []
    for row in rows:
        if full_prompt:
            rec = full_prompt_copy_example(row, rng.randrange(len(row["candidate_sids"])))
        else:
            sids = [str(s) for s in row["candidate_sids"]]
            rng.shuffle(sids)
            rec = copy_example(sids, rng.randrange(len(sids)))
        lines.append(json.dumps(rec, ensure_ascii=False))
    out = data_dir / out_name
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out
