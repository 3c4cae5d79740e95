"""Exact prompt-lookup (n-gram) drafting for greedy AR decoding, on the shared forward and KV cache.

The answer is mostly copied: semantic IDs from the candidate list in the prompt, and a scan that
repeats a fixed template per candidate. So the text so far usually predicts the next tokens: find
the longest recent n-gram that occurred earlier in the prompt or output, draft the k tokens that
followed it, and let the model check all k in one forward. The accepted tokens are the greedy
tokens themselves (a draft token is kept only where it equals the model's arg-max), so the output
is `ar_decode`'s greedy output token for token; a good draft only saves forwards.

Layout and mask rule as ar_decoder.py (masks.py): prompts left-padded to width P, pad keys masked,
explicit position ids, one-token blocks (plain causal attention). A verify step feeds
[last token ; k drafts] (k + 1 columns) causally against the cache.
"""
from dataclasses import dataclass

import torch

from .ar_decoder import ARResult
from .forward import clock, crop, forward, new_cache, pick_tokens, select_rows
from .masks import block_causal_mask, left_pad
from .prompt_prefill import prompt_prefill

DEFAULT_MAX_NGRAM = 3
DEFAULT_K_START = 4
DEFAULT_K_MAX = 16


@dataclass
class LookupResult(ARResult):
    drafted: int = 0   # draft tokens proposed (summed over rows and steps)
    accepted: int = 0  # of those, kept (each equal to the greedy token at its place)


class NgramIndex:
    """One row's text (prompt + output) and, for every n <= max_ngram, where each n-gram last
    ended, so a draft costs max_ngram dict look-ups instead of a scan of the text.

    The n-grams ending at the final token are left out of the index: the suffix being looked up
    must match an EARLIER occurrence, whose continuation is then known."""

    def __init__(self, tokens, max_ngram=DEFAULT_MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens = []
        self.end_of = {}  # n-gram tuple -> index just past its most recent indexed occurrence
        self.extend(tokens)

    def extend(self, tokens):
        start = max(len(self.tokens) - 1, 0)  # the old final token's n-grams become earlier ones now
        self.tokens.extend(int(t) for t in tokens)
        for end in range(start + 1, len(self.tokens)):  # n-grams ending at end - 1, i.e. all but the last
            for n in range(1, min(self.max_ngram, end) + 1):
                self.end_of[tuple(self.tokens[end - n:end])] = end

    def draft(self, k):
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
        n-gram (n from max_ngram down to 1); [] when no suffix occurred before."""
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            end = self.end_of.get(tuple(self.tokens[-n:]))
            if end is not None:
                return self.tokens[end:end + k]
        return []


@torch.no_grad()
def ar_lookup_decode(model, prompts, max_new_tokens, eos_token_id, pad_token_id=0, max_ngram=DEFAULT_MAX_NGRAM,
                     k_start=DEFAULT_K_START, k_max=DEFAULT_K_MAX):
    """Greedy AR decoding with prompt-lookup drafts; the tokens equal ar_decode(..., temperature=0)'s.

    Each step, per row: draft up to k tokens (NgramIndex.draft over prompt + output), run
    [last ; drafts] in one forward, keep the drafts up to the first one that differs from the
    model's arg-max, plus the model's own next token there (so a step always yields >= 1 token).
    k adapts per row, within [1, k_max], starting at k_start: +1 after a draft was kept whole (the
    text is in a copied stretch, draft further), halved after a draft was cut (a miss costs the
    rejected columns' compute, so back off fast). A step without a match drafts nothing and
    leaves k as it was. Drafts are also cut to the row's remaining budget.

    Greedy only: sampled speculative decoding needs a rejection-sampling rule, not this one.
    prompts: list of token-id lists (different lengths are fine).
    """
    if not 1 <= k_start <= k_max:
        raise ValueError(f"need 1 <= k_start <= k_max, got {k_start}, {k_max}")
    dev = model.device
    ids, plen = left_pad(prompts, pad_token_id)
    ids, plen = ids.to(dev), plen.to(dev)
    b, P = ids.shape
    cache = new_cache(model)
    valid = torch.arange(P, device=dev)[None] >= (P - plen)[:, None]
    t0 = clock(dev)
    logits = prompt_prefill(model, ids, plen, P, cache)
    prefill_seconds = clock(dev) - t0
    n_forward, drafted, accepted = 1, 0, 0
    tok, lp, _ = pick_tokens(logits)
    out_tok = [[t] for t in tok.tolist()]
    out_lp = [[x] for x in lp.tolist()]
    index = [NgramIndex(list(p) + [t], max_ngram) for p, t in zip(prompts, tok.tolist())]
    k = [k_start] * b
    rows = [r for r in range(b) if out_tok[r][-1] != eos_token_id and max_new_tokens > 1]  # original row ids
    pos = plen.clone()  # position id of each row's last token (the one not yet in the cache)
    if len(rows) < b:
        keep = torch.tensor(rows, dtype=torch.long, device=dev)
        select_rows(cache, keep)
        valid, pos = valid[keep], pos[keep]
    while rows:
        drafts = [index[r].draft(min(k[r], max_new_tokens - len(out_tok[r]) - 1)) for r in rows]
        width = 1 + max(len(d) for d in drafts)
        new = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        for i, (r, d) in enumerate(zip(rows, drafts)):
            new[i, 0] = out_tok[r][-1]
            new[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        new = new.to(dev)
        n_draft = torch.tensor([len(d) for d in drafts], device=dev)
        # A shorter draft is padded to the batch's width; its pad columns are never keys of a real
        # column (they come after it) and are never accepted, so they change nothing.
        cols = torch.arange(width, device=dev)
        new_valid = cols[None] <= n_draft[:, None]
        kv_blk = torch.arange(valid.shape[1] + width, device=dev)  # one-token blocks: causal over the new columns
        kv_grp = torch.zeros_like(kv_blk)
        mask = block_causal_mask(kv_blk[-width:], kv_grp[-width:], kv_blk, kv_grp, torch.cat([valid, new_valid], 1))
        logits = forward(model, new, pos[:, None] + cols[None], mask, cache)
        n_forward += 1
        greedy, lp, _ = pick_tokens(logits)
        # drafts kept: the run of positions where draft j equals the arg-max after column j - 1
        hit = (new[:, 1:] == greedy[:, :-1]) & (cols[None, 1:] <= n_draft[:, None])
        n_keep = hit.int().cumprod(1).sum(1)
        greedy_l, lp_l, n_keep_l = greedy.tolist(), lp.tolist(), n_keep.tolist()  # one host sync per step
        still = []
        for i, r in enumerate(rows):
            n, d = n_keep_l[i], len(drafts[i])
            drafted, accepted = drafted + d, accepted + n
            if d:
                k[r] = min(k[r] + 1, k_max) if n == d else max(k[r] // 2, 1)
            got = greedy_l[i][:n + 1]  # the kept drafts equal these arg-maxes; the last is the model's own
            got_lp = lp_l[i][:n + 1]
            if eos_token_id in got:
                cut = got.index(eos_token_id) + 1
                got, got_lp = got[:cut], got_lp[:cut]
            out_tok[r] += got
            out_lp[r] += got_lp
            index[r].extend(got)
            if got[-1] != eos_token_id and len(out_tok[r]) < max_new_tokens:
                still.append(i)
        # The cache holds one column count for every row, so a row that kept fewer drafts than
        # another cannot be cropped to its own length: its rejected columns stay as masked holes
        # (a masked key gets weight exactly 0, so this is exact) and only the tail that no row
        # kept is cropped. Re-running the rows that kept less would cost a forward per step; holes
        # cost a few extra masked keys.
        kept_cols = cols[None] <= n_keep[:, None]
        width_kept = max(n_keep_l) + 1
        crop(cache, width - width_kept)
        valid = torch.cat([valid, kept_cols[:, :width_kept]], 1)
        pos = pos + n_keep + 1
        if len(still) < len(rows):
            if not still:
                break
            keep = torch.tensor(still, dtype=torch.long, device=dev)
            select_rows(cache, keep)
            valid, pos = valid[keep], pos[keep]
        rows = [rows[i] for i in still]
    return LookupResult(out_tok, [torch.tensor(x) for x in out_lp], n_forward, prefill_seconds, drafted, accepted)
