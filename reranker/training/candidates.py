"""The candidates of each example, and whether a decoded answer is a valid ranking of them.

The stages that decode while they train (cft validates by greedy decoding, opd rewards rollouts
against the teacher) report a valid-JSON rate: the share of outputs that parse to a permutation of
the example's candidate SIDs. The SIDs come with the example ("candidate_sids") or from the data
dir's sids.json ("candidates" are item ids); without either an example's check is unknown (None).
"""
from __future__ import annotations

from pathlib import Path

from reranker.text.answer import parse_ranking

from .batches import encode_examples, read_train_records


def candidate_sids(records, data_dir) -> list:
    """Per record: its candidate SID strings ("candidate_sids", or "candidates" mapped through the
    data dir's sids.json), or None when neither is available (no valid-JSON check for it)."""
    sids, path = None, Path(data_dir or ".") / "sids.json"
    out = []
    for r in records:
        if r.get("candidate_sids"):
            out.append(list(r["candidate_sids"]))
        elif r.get("candidates") and path.is_file():
            if sids is None:
                from reranker.text.sid import SemanticIds

                sids = SemanticIds.load(path)
            out.append([sids.sid_string(str(c)) for c in r["candidates"]])
        else:
            out.append(None)
    return out


def valid_json(tok, tokens, cands) -> list:
    """Per output: True/False = parses to a permutation of its candidates; None = unknown."""
    return [None if c is None else parse_ranking(tok.decode(t, skip_special_tokens=False), c).ok
            for t, c in zip(tokens, cands)]


def load_split(tok, data_dir, name, limit, max_len):
    """(encoded examples, candidate SIDs, encode stats) of one JSONL file, or of a list of them
    pooled in order (as the sft stage's ``train_file``: a mix of real lists and copy data)."""
    recs = read_train_records(Path(data_dir), name, limit)
    enc, stats = encode_examples(tok, recs, max_len)
    return enc, candidate_sids(recs, data_dir), stats
