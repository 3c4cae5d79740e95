"""Batched autoregressive decoding with a KV cache (the GR2 teacher's decoder, and the baseline).

Same layout and mask rule as block diffusion with B = 1 (masks.py): prompts left-padded, pad keys
masked, explicit position ids. Rows that hit EOS are dropped from the batch (and the cache), so
finished rows cost nothing.
"""
from dataclasses import dataclass

import torch

from .forward import clock, forward, new_cache, pick_tokens, select_rows
from .masks import left_pad, to_additive
from .prompt_prefill import prompt_prefill


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
    valid = torch.arange(P, device=dev)[None] >= (P - plen)[:, None]
    t0 = clock(dev)
    logits = prompt_prefill(model, ids, plen, P, cache)
    prefill_seconds = clock(dev) - t0
    n_forward = 1
    rows = list(range(b))  # original index of each active row
    out_tok = [[] for _ in range(b)]
    out_lp = [[] for _ in range(b)]
    pos = plen[:, None]  # position id of the token fed next
    for step in range(max_new_tokens):
        tok, lp, _ = pick_tokens(logits, temperature, top_p, generator)
        toks = tok.tolist()  # one host sync per step; which rows ended is read from it
        for r, t, l in zip(rows, toks, lp.tolist()):
            out_tok[r].append(t)
            out_lp[r].append(l)
        alive = [i for i, t in enumerate(toks) if t != eos_token_id]
        if step == max_new_tokens - 1 or not alive:
            break
        if len(alive) < len(toks):
            idx = torch.tensor(alive, device=dev)
            select_rows(cache, idx)
            rows, tok, pos, valid = [rows[i] for i in alive], tok[idx], pos[idx], valid[idx]
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
        # One query, the last column: block_causal_mask with one-token blocks lets it see every
        # earlier key that is not padding, i.e. exactly `valid`; built directly, it is two ops
        # instead of a dozen (at this model size a step is mostly per-op overhead).
        mask = to_additive(valid[:, None, None, :])
        logits = forward(model, tok[:, None], pos, mask, cache)[:, -1]
        pos = pos + 1
        n_forward += 1
    return ARResult(out_tok, [torch.tensor(x) for x in out_lp], n_forward, prefill_seconds)
