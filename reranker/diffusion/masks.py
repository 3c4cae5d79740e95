"""Sequence layout and attention masks for the block-diffusion LM (and its B = 1 special case, AR).

Layout (shared by training, decoding and replay). Prompts are LEFT-padded so every prompt ends at
column P (the padded prompt width); the response y follows at column P, right-padded. The AR token
shift is kept: the logit at column c predicts the token at column c + 1. Block k of the response
holds the targets y[kB : kB+B]; its INPUT WINDOW is the B columns just before them,
[P-1+kB, P-1+kB+B), whose first input (z[P-1] or y[kB-1]) is always a clean, known token.
The columns before window 0, [0, P-1), are the causal "prefix".

Every column gets a block id `blk` (prefix column c -> c, window k -> P-1+k; so the prefix is a
chain of one-token blocks, i.e. plain causal attention) and a group id `grp` (0 = clean context,
g > 0 = one noisy window copy). One rule then covers training, cached decoding and replay:

    query i may see key j  <=>  key j is valid and
                                ((grp_j == 0 and blk_j < blk_i) or (grp_j == grp_i and blk_j == blk_i))

i.e. everything sees the clean past, a block sees itself bidirectionally, and nothing outside a
noisy window ever sees into it. Masks are additive float (0 = allowed, dtype-min = blocked), shape
(batch, 1, q_len, kv_len), because transformers 5.x misreads boolean 4D masks under eager.
"""
import math

import torch


def to_additive(allowed, dtype=torch.float32):
    """Boolean 'may attend' -> additive float mask (0 allowed, dtype-min blocked)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def block_causal_mask(q_blk, q_grp, kv_blk, kv_grp, kv_valid=None, dtype=torch.float32):
    """Additive mask (batch, 1, q, kv) from per-column block / group ids (see module docstring).

    The queries are the LAST q columns of the keys (true for a full forward, where q == kv, and for
    a cached forward, where kv = cached + new). Each query may always see its own key, so padded
    rows never get an all-blocked row (which would give NaN under sdpa/eager softmax).
    Ids may be 1D (shared by the batch) or 2D (batch, len); kv_valid is (batch, kv) bool or None.
    """
    q_blk, q_grp, kv_blk, kv_grp = (torch.atleast_2d(x) for x in (q_blk, q_grp, kv_blk, kv_grp))
    qb, qg = q_blk[:, :, None], q_grp[:, :, None]
    kb, kg = kv_blk[:, None, :], kv_grp[:, None, :]
    allowed = ((kg == 0) & (kb < qb)) | ((kg == qg) & (kb == qb))
    if kv_valid is not None:
        allowed = allowed & kv_valid[:, None, :]
    q, kv = allowed.shape[-2:]
    self_key = torch.zeros(q, kv, dtype=torch.bool, device=allowed.device)
    self_key[:, kv - q:] = torch.eye(q, dtype=torch.bool, device=allowed.device)
    return to_additive((allowed | self_key)[:, None], dtype)


def clean_block_ids(n_cols, prefix_len, block_size, device=None):
    """Block id of each clean column: prefix column c -> c, window k -> prefix_len + k."""
    col = torch.arange(n_cols, device=device)
    win = prefix_len + (col - prefix_len).div(block_size, rounding_mode="floor")
    return torch.where(col < prefix_len, col, win)


def position_ids_for(prompt_len, width, n_cols):
    """Position ids of clean columns 0..n_cols-1 for prompts left-padded to `width`; pads get 0."""
    pad = width - prompt_len.view(-1, 1)
    return (torch.arange(n_cols, device=prompt_len.device)[None] - pad).clamp(min=0)


def left_pad(seqs, pad_id, width=None):
    """List of 1D token lists/tensors -> (ids (b, width), lengths (b,)) with left padding."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    width = int(lens.max()) if width is None else width
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
    return ids, lens


def pack_prompt_response(prompts, responses, pad_id, block_size=None, fill_id=None):
    """Training batch in the shared layout: left-padded prompts then right-padded responses.

    Returns (input_ids (b, P + Lmax), prompt_len (b,), resp_len (b,)). If block_size and fill_id
    are given, every response is extended with fill_id (normally EOS) to a multiple of block_size
    and resp_len counts the fill: the decoder shows the model a full last block (masks after EOS),
    so training on "EOS after EOS" keeps that block in distribution and lets the decoder commit
    the tail of the last block in one confident step.
    """
    responses = [list(map(int, r)) for r in responses]
    if block_size and fill_id is not None:
        responses = [r + [fill_id] * (-len(r) % block_size) for r in responses]
    z, plen = left_pad(prompts, pad_id)
    rlen = torch.tensor([len(r) for r in responses], dtype=torch.long)
    y = torch.full((len(responses), int(rlen.max())), pad_id, dtype=torch.long)
    for i, r in enumerate(responses):
        y[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return torch.cat([z, y], 1), plen, rlen


def diffusion_training_mask(prompt_len, resp_len, block_size, n_noisy_copies=1, width=None,
                            n_blocks=None, dtype=torch.float32):
    """Mask and position ids for [clean sequence ; noisy copy 1 ; ... ; noisy copy C].

    prompt_len, resp_len: (b,) long. The clean part is the P-1 prefix columns plus n windows
    (n = ceil(max resp_len / B)), i.e. inputs x[0 : P-1+nB]; each noisy copy is n windows of B
    columns, window k of copy c standing in for clean window k (same position ids). Window columns
    whose target lies past a row's response are invalid keys. Returns (mask (b,1,T,T), position_ids
    (b,T)) with T = P-1+nB + C*nB. With several copies per block the same mask replays many
    denoising steps of one block in a single forward (each copy only ever sees itself + clean past).
    """
    P = int(prompt_len.max()) if width is None else width
    B = block_size
    n = math.ceil(int(resp_len.max()) / B) if n_blocks is None else n_blocks
    dev = prompt_len.device
    n_clean = P - 1 + n * B
    blk_c = clean_block_ids(n_clean, P - 1, B, dev)
    pos_c = position_ids_for(prompt_len, P, n_clean)
    col = torch.arange(n_clean, device=dev)[None]
    valid_c = (col >= (P - prompt_len)[:, None]) & (col - (P - 1) < resp_len[:, None])
    win = slice(P - 1, n_clean)
    blk = torch.cat([blk_c] + [blk_c[win]] * n_noisy_copies)
    grp = torch.cat([torch.zeros(n_clean, dtype=torch.long, device=dev)]
                    + [torch.full((n * B,), c + 1, dtype=torch.long, device=dev) for c in range(n_noisy_copies)])
    pos = torch.cat([pos_c] + [pos_c[:, win]] * n_noisy_copies, 1)
    valid = torch.cat([valid_c] + [valid_c[:, win]] * n_noisy_copies, 1)
    return block_causal_mask(blk, grp, blk, grp, valid, dtype), pos
