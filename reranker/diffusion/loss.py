"""Masked-diffusion loss for block-diffusion training (CFT), in ONE forward over [x_0 ; x_t].

Per example t ~ U(eps, 1); every response target is masked with probability t; cross-entropy on
masked targets only, weighted by 1/t (the usual masked-diffusion ELBO weight) and by a per-token
weight (lambda_r for reasoning tokens, lambda_o for answer tokens, chosen by the caller), summed and
divided by the number of response tokens in the batch.

Layout (masks.py): target y_i is predicted by the logit at window column P-1+i, so masking y_i
means (a) its loss is counted at window index i % B and (b) its INPUT copy, one column to the right
inside the same window, becomes the mask token. The first input of every window is never a target
of that block, so it always stays clean; the last target of a block is only an input of the next
window (which sees the clean copy), so masking it only decides whether its loss counts.

Default: one noisy copy with independent masks, as in the paper ([x_t ; x_0]), the cheaper forward
(clean + one copy). Option `complementary=True`: two noisy copies with complementary masks (probs t
and 1-t, t ~ U(eps, 1-eps)), so every target is supervised exactly once per step; lower variance
per example for ~1.5x the tokens per forward; the two unbiased estimates are averaged.

Option `suffix_prob` (CFT's `suffix_fraction`): that share of examples has its masks moved to the
END of each block, keeping each block's masked count (`suffix_aligned`). The prefix commit rule
only ever shows the model such canvases (a committed prefix of the active block, then masks), so
these examples train exactly the predictions it commits from; the count, hence the 1/t weight,
has the same distribution as under independent masks. With `complementary` each copy is aligned
on its own (the two copies are then no longer complementary).
"""
import math

import torch
import torch.nn.functional as F

from .forward import forward
from .masks import diffusion_training_mask


def noisy_windows(clean_windows, target_mask, block_size, mask_token_id):
    """Window inputs (b, nB) with the input copy of each masked target replaced by the mask token.
    clean_windows[:, i] is the input at window column i (= y_{i-1}, or z_{P-1} for i = 0)."""
    hide = torch.zeros_like(target_mask)
    hide[:, 1:] = target_mask[:, :-1]       # y_{i} sits as input at column i+1
    hide[:, ::block_size] = False           # first input of each window: previous block, clean
    return torch.where(hide, mask_token_id, clean_windows)


def suffix_aligned(target_mask, block_size):
    """The same number of masked targets per block, moved to the block's end: (..., n_cols) bool
    with n_cols a multiple of block_size (a response EOS-filled to whole blocks)."""
    *lead, n = target_mask.shape
    if n % block_size:
        raise ValueError(f"suffix-aligned masks need whole blocks: {n} columns, block size {block_size}")
    count = target_mask.view(*lead, n // block_size, block_size).sum(-1, keepdim=True)
    col = torch.arange(block_size, device=target_mask.device)
    return (col >= block_size - count).view(*lead, n)


def sample_noise(resp_len, n_cols, eps=1e-3, complementary=False, generator=None, block_size=None,
                 suffix_prob=0.0):
    """t (C, b) and target masks (C, b, n_cols) with C = 2 if complementary else 1; with
    suffix_prob > 0 each example's masks are suffix-aligned per block with that probability."""
    b = len(resp_len)
    dev = resp_len.device
    t = eps + (1 - (2 if complementary else 1) * eps) * torch.rand(b, generator=generator, device=dev)
    u = torch.rand(b, n_cols, generator=generator, device=dev)
    m = u < t[:, None]
    t, m = (torch.stack([t, 1 - t]), torch.stack([m, ~m])) if complementary else (t[None], m[None])
    if suffix_prob > 0:  # drawn only when asked: seeded runs without it keep their old noise
        if block_size is None:
            raise ValueError("suffix_prob needs block_size")
        pick = torch.rand(b, generator=generator, device=dev) < suffix_prob
        m = torch.where(pick[None, :, None], suffix_aligned(m, block_size), m)
    return t, m


def diffusion_loss(model, input_ids, prompt_len, resp_len, block_size, mask_token_id, token_weights=None,
                   complementary=False, eps=1e-3, generator=None, t=None, target_mask=None):
    """Masked-diffusion loss. input_ids (b, P + Lmax) from masks.pack_prompt_response (prompts
    left-padded to P = max prompt_len, responses right-padded); token_weights (b, Lmax) per response
    token (default 1). t (C, b) and target_mask (C, b, >= Lmax) may be given (tests); else drawn.
    """
    B = block_size
    P = int(prompt_len.max())
    n = math.ceil(int(resp_len.max()) / B)
    y = input_ids[:, P:P + n * B]
    y = F.pad(y, (0, n * B - y.shape[1]))  # the filler is never supervised (weight 0)
    clean = torch.cat([input_ids[:, :P], y[:, :-1]], 1)                 # P-1 prefix + n windows
    if target_mask is None:
        t, target_mask = sample_noise(resp_len, n * B, eps, complementary, generator)
    target_mask = target_mask[..., :n * B]
    C = target_mask.shape[0]
    windows = clean[:, P - 1:]
    noisy = [noisy_windows(windows, target_mask[c], B, mask_token_id) for c in range(C)]
    mask, pos = diffusion_training_mask(prompt_len, resp_len, B, C, width=P, n_blocks=n,
                                        dtype=model.dtype)
    logits = forward(model, torch.cat([clean] + noisy, 1), pos, mask, logits_to_keep=C * n * B)
    logits = logits.view(-1, C, n * B, logits.shape[-1]).transpose(0, 1)  # (C, b, nB, V)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.repeat(C, 1).reshape(-1),
                         reduction="none").view(C, -1, n * B)
    valid = torch.arange(n * B, device=y.device)[None] < resp_len[:, None]
    w = valid.float()
    if token_weights is not None:
        tw = token_weights[:, :n * B].float()
        w = w * F.pad(tw, (0, n * B - tw.shape[1]))
    per_tok = ce * target_mask.float() * w / t[..., None]
    return per_tok.sum() / (C * valid.sum().clamp(min=1))
