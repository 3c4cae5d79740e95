"""Replay recorded denoising trajectories under the current weights, with gradients.

Every committed token is re-scored on exactly the canvas it was committed from, which is what OPD
(student scored where it actually decided) and TraceRL-style RL (importance ratios of the real
decoding policy, not a one-step mean-field proxy) need. One forward per batch covers all steps of
all blocks: the input is [clean sequence ; one noisy window per (block, step)], and the mask rule of
masks.py lets window (k, s) see the prefix, clean windows < k and itself only, so it is the very
computation the decoder did against its KV cache.
"""
import math

import torch

from .forward import forward
from .masks import block_causal_mask, clean_block_ids, left_pad, position_ids_for


def _diffusion_ids(model, mask_token_id, pad_token_id):
    info = getattr(model.config, "diffusion", None) or {}
    mask_token_id = info.get("mask_token_id") if mask_token_id is None else mask_token_id
    pad = getattr(model.config, "pad_token_id", None) if pad_token_id is None else pad_token_id
    return mask_token_id, 0 if pad is None else pad


def replay_logits(model, prompts, trajectories, block_size, mask_token_id=None, pad_token_id=None,
                  max_windows=None):
    """Logits (b, n*B, V) for every response position, taken from the window of the step at which
    that position was committed (zeros where never committed), and a bool (b, n*B) committed mask.
    max_windows bounds the noisy windows per forward (memory); each chunk re-runs the clean part."""
    mask_token_id, pad_token_id = _diffusion_ids(model, mask_token_id, pad_token_id)
    dev, B = model.device, block_size
    ids, plen = left_pad(prompts, pad_token_id)
    ids, plen = ids.to(dev), plen.to(dev)
    b, P = ids.shape
    pre = P - 1
    n = max(math.ceil(len(t.tokens) / B) for t in trajectories)
    tok = torch.full((b, n * B), mask_token_id, dtype=torch.long, device=dev)
    step = torch.full_like(tok, -1)
    for r, t in enumerate(trajectories):
        tok[r, :len(t.tokens)] = t.tokens.to(dev)
        step[r, :len(t.steps)] = t.steps.to(dev)
    committed = step >= 0
    # Clean part: prefix + every window with its committed tokens (only blocks < k are ever read).
    clean = torch.cat([ids, tok[:, :-1]], 1)
    n_clean = pre + n * B
    blk_c = clean_block_ids(n_clean, pre, B, dev)
    pos_c = position_ids_for(plen, P, n_clean)
    col = torch.arange(n_clean, device=dev)
    resp_cols = torch.tensor([len(t.tokens) for t in trajectories], device=dev)
    valid_c = (col[None] >= (P - plen)[:, None]) & (col[None] - pre < resp_cols[:, None])
    # Noisy part: windows (k, s) for s < number of steps block k took; padded to the batch max.
    S = torch.where(committed, step, -1).view(b, n, B).amax(-1) + 1  # (b, n) steps per block
    blocks = [torch.repeat_interleave(torch.arange(n, device=dev), S[r]) for r in range(b)]
    steps = [torch.cat([torch.arange(int(c), device=dev) for c in S[r]]) for r in range(b)]
    W = max(1, max(len(x) for x in blocks))
    wk = torch.zeros(b, W, dtype=torch.long, device=dev)
    ws = torch.full((b, W), -1, dtype=torch.long, device=dev)
    for r in range(b):
        wk[r, :len(blocks[r])], ws[r, :len(steps[r])] = blocks[r], steps[r]
    real = ws >= 0                                                   # (b, W)
    j = torch.arange(B, device=dev)
    tcol = wk[..., None] * B + j                                     # (b, W, B) target index
    t_tok, t_step = tok.gather(1, tcol.view(b, -1)).view(b, W, B), step.gather(1, tcol.view(b, -1)).view(b, W, B)
    visible = (t_step >= 0) & (t_step < ws[..., None])               # canvas at step s
    canvas = torch.where(visible, t_tok, mask_token_id)
    first = clean.gather(1, pre + wk * B)                            # clean first input of window k
    noisy = torch.cat([first[..., None], canvas[..., :-1]], -1).view(b, W * B)
    n_blk = (pre + wk[..., None]).expand(b, W, B).reshape(b, W * B)
    n_grp = (1 + torch.arange(W, device=dev))[None, :, None].expand(b, W, B).reshape(b, W * B)
    n_pos = pos_c.gather(1, (pre + tcol).view(b, -1))
    n_valid = real[..., None].expand(b, W, B).reshape(b, W * B)
    grp_c = torch.zeros(b, n_clean, dtype=torch.long, device=dev)
    chunk = (max_windows or W) * B
    parts = []
    for a in range(0, W * B, chunk):
        z = slice(a, a + chunk)
        blk = torch.cat([blk_c[None].expand(b, -1), n_blk[:, z]], 1)
        grp = torch.cat([grp_c, n_grp[:, z]], 1)
        mask = block_causal_mask(blk, grp, blk, grp, torch.cat([valid_c, n_valid[:, z]], 1))
        logits = forward(model, torch.cat([clean, noisy[:, z]], 1), torch.cat([pos_c, n_pos[:, z]], 1), mask)
        parts.append(logits[:, n_clean:])
    logits = torch.cat(parts, 1).view(b, W, B, -1)
    # Scatter window logits back to the positions committed at that window's step.
    hit = (t_step == ws[..., None]) & real[..., None]                # (b, W, B)
    out = torch.zeros(b, n * B, logits.shape[-1], device=dev, dtype=logits.dtype)
    bi = torch.arange(b, device=dev)[:, None, None].expand(b, W, B)
    out = out.index_put((bi[hit], tcol[hit]), logits[hit])
    return out, committed


def replay_logprobs(model, prompts, trajectories, block_size, temperature=0.0, mask_token_id=None,
                    pad_token_id=None, max_windows=None):
    """log p(committed token | its canvas) under softmax(logits / T) (T = 1 when temperature == 0),
    shape (b, n*B) aligned with trajectory positions, 0 where never committed; differentiable."""
    logits, committed = replay_logits(model, prompts, trajectories, block_size, mask_token_id, pad_token_id,
                                      max_windows)
    T = temperature if temperature > 0 else 1.0
    b, L = committed.shape
    tok = torch.zeros(b, L, dtype=torch.long, device=logits.device)
    for r, t in enumerate(trajectories):
        tok[r, :len(t.tokens)] = t.tokens.to(logits.device)
    lp = torch.log_softmax(logits / T, -1).gather(-1, tok[..., None]).squeeze(-1)
    return lp * committed
