"""Copy warm-up data: teach a freshly initialised LM to copy semantic IDs before it learns to rank.

Why: the answer is a JSON list of candidate SIDs, four tokens each, that must be copied out of the
prompt. A small randomly initialised model trained only on the re-ranking task did not learn to
copy (measured on Beauty: after 666 SFT steps it chose the right second SID token given the first
only ~50% of the time, teacher forced, and greedy decoding gave 0% valid rankings: repeated or
invented SIDs). Copying needs induction-style attention, which the ranking loss alone teaches
slowly because most of it is spent on other tokens.

Copying is not memorising. A model trained on real SIDs can predict a SID's later codes from its
first one by remembering the catalogue (which items start with <a_5>), not by reading the prompt:
measured on Beauty, a model that got the second SID level right 0.81 of the time on full prompts
got it right 0.06 of the time once every SID of the same prompts was relabelled at random. So
`relabel_sids` rewrites a record's SIDs with random codes (consistently: one item, one new SID;
candidates sharing a prefix keep sharing it), and `random_sids=True` builds the warm-up from such
records: the only way to lower their loss is to copy, and `dgr2 sid-copy` on held-out relabelled
examples measures copying alone.

Each warm-up example is short: the candidate SIDs of a training list in a shuffled order, the
instruction "put #k first, then the rest in retriever order", and the answer in exactly the
re-ranking format (a one-sentence <think> block, then {"ranking": [...]}). Every answer token is
determined by the prompt, so the only way to lower the loss is to copy. Nothing here looks at
targets: k is drawn at random.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

from candidate_gen.files import atomic_write_text, read_jsonl

from reranker.text.prompt import prompt_candidate_order, prompt_candidate_sids, render_assistant, reorder_candidates
from reranker.text.sid import SID_CODEBOOK, SID_RE, SemanticIds, format_sid

SYSTEM = "Copy the candidates."


def relabel_sids(record: dict, rng: random.Random, last_codes: int | None = None) -> dict:
    """`record` (prompt_messages + assistant) with every SID replaced by a random one: the same
    SID always maps to the same new SID, and SIDs sharing a prefix (first code, first two, first
    three) map to SIDs sharing the same prefix, so the prompt keeps its structure and only the
    codes change. Randomness comes from `rng`, so the result is seeded.

    The last (dedup) code is kept unless `last_codes` is given; then it is drawn from
    range(last_codes) too. Why: the dedup code is 0 for most items (Beauty: 9,650 of 12,101) and
    its high values label a handful of items each, so those tokens are almost never copied in
    training, and the model's invalid answers were nearly all such a code miscopied (<d_27> written
    as <d_22>). Drawn uniformly, every dedup token is copied as often as any other."""
    prefix: dict[tuple, int] = {}

    def new_code(key: tuple, size: int = SID_CODEBOOK) -> int:
        if key not in prefix:
            prefix[key] = rng.randrange(size)
        return prefix[key]

    owner: dict[str, str] = {}  # new SID -> the SID it replaces: two SIDs must never merge

    def sub(m: re.Match) -> str:
        a, b, c, d = m.groups()
        for _ in range(10_000):
            last = d if last_codes is None else new_code((a, b, c, d), last_codes)
            sid = format_sid((new_code((a,)), new_code((a, b)), new_code((a, b, c)), last))
            if owner.setdefault(sid, m.group(0)) == m.group(0):
                return sid
            # collided with another SID's relabelling: draw its own code again (the dedup code when
            # it is drawn, else the third)
            del prefix[(a, b, c) if last_codes is None else (a, b, c, d)]
        raise ValueError(f"relabel_sids: no free code for {m.group(0)} (last_codes={last_codes} too small?)")

    messages = [{**m, "content": SID_RE.sub(sub, m["content"])} for m in record["prompt_messages"]]
    out = {**record, "prompt_messages": messages, "assistant": SID_RE.sub(sub, record["assistant"])}
    if "candidate_sids" in record:
        out["candidate_sids"] = [SID_RE.sub(sub, s) for s in record["candidate_sids"]]
    return out


def _promote_answer(sids: list[str], k: int, candidate_order: str = "retriever") -> str:
    """The assistant text of a copy task: a one-sentence <think> block, then #k first and the rest
    in the listed order (which ``candidate_order`` names), in the re-ranking answer format."""
    if not 0 <= k < len(sids):
        raise ValueError(f"promoted index {k} outside 0..{len(sids) - 1}")
    order = [sids[k]] + [s for i, s in enumerate(sids) if i != k]
    think = f"<think>\n{sids[k]} (#{k + 1}) first, then the rest in {candidate_order} order.\n</think>\n"
    return think + json.dumps({"ranking": order}, ensure_ascii=False)


def copy_example(sids: list[str], k: int) -> dict:
    """One warm-up record (prompt_messages + assistant) for candidate SIDs `sids` and promoted index k."""
    assistant = _promote_answer(sids, k)
    lines = "\n".join(f"{i + 1}.{s}" for i, s in enumerate(sids))
    user = f"Candidates (retriever order).\n{lines}\nPut #{k + 1} first, then the rest in retriever order."
    return {"prompt_messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "assistant": assistant}


def full_prompt_copy_example(record: dict, k: int) -> dict:
    """The same copy task inside a real re-ranking prompt (history SIDs and evidence lines included,
    the distractors a short prompt lacks): its last line asks for #k first (as the prompt numbers
    them), then the rest in the prompt's order."""
    messages = [dict(m) for m in record["prompt_messages"]]
    text = messages[-1]["content"]
    order = prompt_candidate_order(text)
    # the SIDs as the prompt numbers them (a prompt without numbered lines: the record's, as they came)
    shown = prompt_candidate_sids(text) or [str(c) for c in record["candidate_sids"]]
    assistant = _promote_answer(shown, k, order)
    body = text.rstrip("\n").rsplit("\n", 1)[0]  # drop the "Rank all N candidates." line
    messages[-1]["content"] = f"{body}\nPut #{k + 1} first, then the rest in {order} order."
    return {"prompt_messages": messages, "assistant": assistant}


def _random_sid_list(rng: random.Random, n_sids: int) -> list[str]:
    """`n_sids` distinct random SIDs that share prefixes as a real candidate list does: first codes
    from a small per-list pool, some second and third codes tied to the code before, so copying
    must look past the first code."""
    pool = [rng.randrange(SID_CODEBOOK) for _ in range(rng.choice([1, 2, 3, 5, 10]))]
    sids: dict[str, None] = {}  # insertion-ordered (a set's order changes with PYTHONHASHSEED)
    while len(sids) < n_sids:
        a = rng.choice(pool)
        b = rng.randrange(SID_CODEBOOK) if rng.random() < 0.6 else (a * 7) % SID_CODEBOOK
        c = rng.randrange(SID_CODEBOOK) if rng.random() < 0.7 else (b * 11) % SID_CODEBOOK
        sids[format_sid((a, b, c, rng.randrange(4)))] = None
    order = list(sids)
    rng.shuffle(order)
    return order


def straight_copy_lists(n: int, seed: int = 0, n_sids: int = 10) -> list[dict]:
    """`n` records that copy a list of random SIDs verbatim: the prompt is the JSON list, the answer
    is the same JSON list (after a one-word <think> block). No catalogue to recall and no line to
    find, only the plainest copy: measured on Beauty, a fresh "cpu" model learns it in ~150 steps
    of 32 (answer NLL 1.8 -> 0.01 between steps 100 and 190: induction heads forming), where it
    learned nothing about random SIDs inside the real prompt layout in as many steps. First codes
    come from a small per-list pool, and some second and third codes are tied to the code before,
    so lists share prefixes as real candidate lists do and copying must look past the first code."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        order = _random_sid_list(rng, n_sids)
        listing = json.dumps({"ranking": order})
        out.append({"prompt_messages": [{"role": "system", "content": "Copy the list."},
                                        {"role": "user", "content": listing}],
                    "assistant": "<think>\ncopy\n</think>\n" + listing})
    return out


def lookup_copy_lists(n: int, seed: int = 0, n_sids: int = 10) -> list[dict]:
    """`n` records that look candidates up by number, the step a scan trace's decision takes
    ("#6.<sid> first"): the prompt numbers random SIDs the way a re-ranking prompt does
    ("6.<sid> cobought 1/0/2; brand 3", after a few unnumbered history SIDs) and asks for an order of
    numbers; the answer writes "#k.<sid>" for each, one per line, then the ranking in that order.
    Why: finding "#6." in the prompt and copying the SID after it is a match two tokens back (".",
    then "<|sid_begin|>", sit between the number and the codes), which a straight copy never needs
    and a scan trace asks once per list; here every example asks it n_sids times. Measured on
    Beauty, the decision's SID is the one miscopied most, but 300 steps of these between the
    straight copies and the SFT mix made the mix worse, not better (docs/EXPERIMENTS.md, "Where the
    teacher miscopies"), so no recipe uses them; they stay for that experiment and for probes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sids = _random_sid_list(rng, n_sids)
        history = _random_sid_list(rng, rng.randrange(6)) if rng.random() < 0.8 else []
        asked = list(range(n_sids))
        rng.shuffle(asked)
        lines = [f"{i + 1}.{s} cobought {rng.randrange(10)}/{rng.randrange(10)}/{rng.randrange(10)}; "
                 f"brand {rng.randrange(10)}" for i, s in enumerate(sids)]
        user = ("History:\n" + "".join(f"{h}\n" for h in history) if history else "") + \
            "Candidates.\n" + "\n".join(lines) + "\nOrder: " + " ".join(f"#{k + 1}" for k in asked)
        think = "\n".join(f"#{k + 1}.{sids[k]}" for k in asked)
        ranking = json.dumps({"ranking": [sids[k] for k in asked]})
        out.append({"prompt_messages": [{"role": "system", "content": "Look the candidates up."},
                                        {"role": "user", "content": user}],
                    "assistant": f"<think>\n{think}\n</think>\n{ranking}"})
    return out


def uniform_pick_order(keys, rng: random.Random) -> list[int]:
    """A candidate order in which a scan's pick (the first of the largest ``keys``) lands at a
    uniformly drawn position, as far as ties allow: one of the tied best is placed there, the
    rest of them after it. Why: in real lists the scan picks the retriever's #1 46% of the time
    and #4-#10 a quarter of the time in all (Beauty training lists), so the decision's lookup by
    number ("#6.<sid>") is rarely trained past the first lines; a model trained that way copied
    #1's SID in its place and got no decision right past #3 (docs/EXPERIMENTS.md)."""
    best = max(keys)
    tied = [j for j, k in enumerate(keys) if k == best]
    others = [j for j, k in enumerate(keys) if k != best]
    at = rng.randrange(len(others) + 1)
    pick = rng.choice(tied)
    rng.shuffle(others)
    after = others[at:] + [j for j in tied if j != pick]
    rng.shuffle(after)
    return others[:at] + [pick] + after


def reorder_for_uniform_pick(record: dict, style: str, rng: random.Random) -> dict:
    """``record`` (a real list: prompt_messages, candidate_sids) with its candidates reordered by
    `uniform_pick_order` under the ``style`` scan: lines renumbered, the order line rewritten,
    candidate_sids in the new order."""
    from .retrace import rule_keys, user_text  # retrace imports the dataset module, which is heavy

    text = user_text(record)
    if prompt_candidate_order(text) != "retriever":
        raise ValueError("uniform_pick shuffles a retriever-ordered prompt; this one lists the candidates in "
                         f"{prompt_candidate_order(text)} order, which a shuffle would misname")
    sids = prompt_candidate_sids(text)
    order = uniform_pick_order(rule_keys(text, len(sids), style), rng)
    text = reorder_candidates(text, sids, order)
    messages = [dict(m, content=text) if m.get("role") == "user" else dict(m) for m in record["prompt_messages"]]
    return {**record, "prompt_messages": messages, "candidate_sids": [sids[j] for j in order]}


def scan_copy_example(record: dict, style: str) -> dict:
    """A real re-ranking list (prompt unchanged) answered by a rule-scan trace style (`retrace`'s
    RULE_LABEL_STYLES): relabelled with `relabel_sids`, it teaches copying in the exact format the
    model is trained and served with."""
    from .retrace import rule_scan, user_text  # retrace imports the dataset module, which is heavy

    text = user_text(record)
    sids = prompt_candidate_sids(text)  # as the prompt lists them (its order may be the pre-ranker's)
    trace, ranking = rule_scan(text, sids, style)
    return {"prompt_messages": [dict(m) for m in record["prompt_messages"]],
            "assistant": render_assistant(trace, [sids[j] for j in ranking])}


def _last_codebook(data_dir: Path) -> int:
    """The size of the last (dedup) SID level of a data dir, from its sids.json."""
    path = data_dir / "sids.json"
    try:
        sizes = SemanticIds.load(path).meta["codebook_sizes"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: cannot read meta.codebook_sizes ({err})") from None
    if not sizes or not 1 <= int(sizes[-1]) <= SID_CODEBOOK:
        raise ValueError(f"{path}: meta.codebook_sizes {sizes!r} has no last level in 1..{SID_CODEBOOK}")
    return int(sizes[-1])


def build_copy_warmup(data_dir, out_name: str = "copy_warmup.jsonl", seed: int = 0, limit: int | None = None,
                      source: str = "train.jsonl", full_prompt: bool = False, random_sids: bool = False,
                      out_path=None, straight: int | None = None, trace_style: str | None = None,
                      relabel_last_code: bool = False, lookup: int | None = None,
                      uniform_pick: bool = False) -> Path:
    """Write <data_dir>/<out_name>: one warm-up example per list of <data_dir>/<source>
    (train.jsonl for training; valid.jsonl gives held-out examples for the SID-copy diagnostic).
    full_prompt: keep the list's real prompt (its candidate order, history and evidence) instead of a
    short shuffled list of SIDs. random_sids: relabel every SID at random (`relabel_sids`), so the
    examples test and teach copying, not the catalogue. out_path: write there instead (held-out probe
    files belong outside the data dir, whose fingerprint covers every top-level JSONL file).
    straight: write that many `straight_copy_lists` records instead (no source lists are read).
    lookup: write that many `lookup_copy_lists` records instead (no source lists are read).
    trace_style: a rule-scan style ("scan", "scan_recent", "scan_brand", each also "_top3"): keep each real prompt and
    answer it with that style's trace and pick (`scan_copy_example`) instead of "put #k first".
    relabel_last_code: with random_sids, draw the dedup code too, uniformly over the data's own
    last codebook (sids.json), so rare dedup tokens are copied as often as common ones.
    uniform_pick: with trace_style, reorder each list's candidates so the scan's pick lands at a
    uniformly drawn position (`reorder_for_uniform_pick`), not mostly at #1."""
    data_dir = Path(data_dir)
    out = Path(out_path) if out_path is not None else data_dir / out_name
    if straight is not None and lookup is not None:
        raise ValueError("straight and lookup are two kinds of copy draw: give one (a phase per draw)")
    for key, count, make in (("straight", straight, straight_copy_lists), ("lookup", lookup, lookup_copy_lists)):
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{key} must be a whole number of lists >= 1, got {count!r}")
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in make(count, seed)))
        return out
    if trace_style is not None:
        from .retrace import RULE_LABEL_STYLES

        if trace_style not in RULE_LABEL_STYLES:
            raise ValueError(f"trace_style must be one of {RULE_LABEL_STYLES}, got {trace_style!r}")
    if uniform_pick and trace_style is None:
        raise ValueError("uniform_pick needs trace_style (it places the scan's pick)")
    if relabel_last_code and not random_sids:
        raise ValueError("relabel_last_code needs random_sids (it relabels the dedup code of random SIDs)")
    last_codes = _last_codebook(data_dir) if relabel_last_code else None
    required = ({"candidate_sids": list, "prompt_messages": list} if full_prompt or trace_style
                else {"candidate_sids": list})
    rows = read_jsonl(data_dir / source, required, limit)
    rng = random.Random(seed)
    lines = []
    for row in rows:
        if trace_style is not None:
            if uniform_pick:
                row = reorder_for_uniform_pick(row, trace_style, rng)
            rec = scan_copy_example(row, trace_style)
        elif full_prompt:
            rec = full_prompt_copy_example(row, rng.randrange(len(row["candidate_sids"])))
        else:
            sids = [str(s) for s in row["candidate_sids"]]
            rng.shuffle(sids)
            rec = copy_example(sids, rng.randrange(len(sids)))
        if random_sids:
            rec = relabel_sids(rec, rng, last_codes)
        lines.append(json.dumps(rec, ensure_ascii=False))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out
