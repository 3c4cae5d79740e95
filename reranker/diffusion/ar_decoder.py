"""Batched autoregressive decoding with a KV cache (the GR2 teacher's decoder, and the baseline).

Same layout and mask rule as block diffusion with B = 1 (masks.py): prompts left-padded, pad keys
masked, explicit position ids. Rows that hit EOS are dropped from the batch (and the cache), so
finished rows cost nothing.
"""
from dataclasses import dataclass

import torch

from .forward import clock, forward, new_cache, pick_tokens, select_rows
from .masks import block_causal_mask, left_pad, position_ids_for


@dataclass
class ARResult:
    tokens: list       # per row: generated ids, up to and including EOS
    logprobs: list     # per row: float tensor, log p(token) under softmax(logits / T)
    n_forward: int     # model forward passes (prefill included)
    prefill_seconds: float = 0.0  # wall time of the prompt prefill (it also yields the first token)


@torch.no_grad()
def ar_decode(model, prompts, max_new_tokens, eos_token_id, pad_token_id=0, temperature=0.0,
              top_p=1.0, generator=None):
    """Greedy (temperature 0) or sampled (temperature / top-p, seeded generator) AR decoding.

    prompts: list of token-id lists (different lengths are fine).
    """
    dev = model.device
    ids, plen = left_pad(prompts, pad_token_id)
    ids, plen = ids.to(dev), plen.to(dev)
    b, P = ids.shape
    cache = new_cache(model)
    blk = torch.arange(P, device=dev)  # causal = one-token blocks
    grp = torch.zeros(P, dtype=torch.long, device=dev)
    valid = torch.arange(P, device=dev)[None] >= (P - plen)[:, None]
    t0 = clock(dev)
    mask = block_causal_mask(blk, grp, blk, grp, valid)
    logits = forward(model, ids, position_ids_for(plen, P, P), mask, cache, logits_to_keep=1)[:, -1]
    prefill_seconds = clock(dev) - t0
    n_forward = 1
    rows = torch.arange(b, device=dev)  # original index of each active row
    out_tok = [[] for _ in range(b)]
    out_lp = [[] for _ in range(b)]
    for step in range(max_new_tokens):
        tok, lp, _ = pick_tokens(logits, temperature, top_p, generator)
        for r, t, l in zip(rows.tolist(), tok.tolist(), lp.tolist()):  # one host sync per step
            out_tok[r].append(t)
            out_lp[r].append(l)
        keep = tok != eos_token_id
        if step == max_new_tokens - 1 or not keep.any():
            break
        if not keep.all():
            idx = keep.nonzero().squeeze(1)
            select_rows(cache, idx)
            rows, tok, plen, valid = rows[idx], tok[idx], plen[idx], valid[idx]
        col = P + step  # column of the token being fed
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
        kv_blk = torch.arange(col + 1, device=dev)
        mask = block_causal_mask(kv_blk[-1:], grp[:1], kv_blk, torch.zeros_like(kv_blk), valid)
        pos = (col - (P - plen))[:, None]
        logits = forward(model, tok[:, None], pos, mask, cache)[:, -1]
        n_forward += 1
    return ARResult(out_tok, [torch.tensor(x) for x in out_lp], n_forward, prefill_seconds)
