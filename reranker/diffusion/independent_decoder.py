"""Block diffusion in a batch whose rows move through their blocks independently.

The lockstep decoder (diffusion_decoder.py) advances every row through block k together: a row
whose block is done after 2 steps waits while another takes 6, so a batch costs its slowest row's
steps in every block. Here each row keeps its own block index and step count, and a row that
finishes a block starts the next one at the very next forward. One forward then serves rows in
different blocks; what makes that exact is that the mask only ever asks "is this key a clean column
of an earlier block of my row, or my own window?" (masks.py), and block and validity ids are kept
per row.

A row entering a new block writes its finished block's clean window into the cache in the same
forward as its first noisy window (as the lockstep decoder does). Those B cache columns are appended
for every row; for the rows that had no block to write they are padding (invalid keys). Greedy
decoding gives each row the tokens it gets decoded alone (a test), and the same trajectory record,
so OPD and RL can replay it. Sampled decoding draws in another order than the lockstep decoder,
so the two agree in distribution there, not draw for draw.
"""
import math

import torch

from reranker.decoding import DEFAULT_COMMIT_RULE, DEFAULT_TAU

from .diffusion_decoder import _first_eos, choose_commits, collect_result, needed_columns, prefill
from .forward import check_commit_rule, clock, crop, forward, select_rows
from .masks import block_causal_mask, left_pad


def ragged_block_step(model, cache, cache_blk, cache_valid, window, window_pos, window_blk, pending=None, keep=None):
    """One denoising step for rows in different blocks. cache_blk / cache_valid: (b, cols) per row;
    window_blk: (b,) each row's block id. pending = (ids, pos, blk (b,), has (b,) bool): the clean
    window of the block a row just finished, written to the cache in this forward where `has`.
    Returns (logits (b, len(keep), V), cache_blk, cache_valid)."""
    b, B = window.shape
    dev = window.device
    ids, pos = window, window_pos
    q_blk = window_blk[:, None].expand(b, B)
    q_grp = torch.ones(b, B, dtype=torch.long, device=dev)
    q_valid = torch.ones(b, B, dtype=torch.bool, device=dev)
    if pending is not None:
        p_ids, p_pos, p_blk, has = pending
        ids, pos = torch.cat([p_ids, ids], 1), torch.cat([p_pos, pos], 1)
        q_blk = torch.cat([p_blk[:, None].expand(b, B), q_blk], 1)
        q_grp = torch.cat([torch.zeros_like(q_grp), q_grp], 1)
        q_valid = torch.cat([has[:, None].expand(b, B), q_valid], 1)
    kv_blk = torch.cat([cache_blk, q_blk], 1)
    kv_grp = torch.cat([torch.zeros_like(cache_blk), q_grp], 1)
    kv_valid = torch.cat([cache_valid, q_valid], 1)
    offset = ids.shape[1] - B  # the noisy window is the last B columns
    keep = torch.arange(B, device=dev) if keep is None else keep.to(dev)
    logits = forward(model, ids, pos, block_causal_mask(q_blk, q_grp, kv_blk, kv_grp, kv_valid), cache,
                     logits_to_keep=keep + offset)
    crop(cache, B)
    if pending is not None:
        cache_blk, cache_valid = kv_blk[:, :-B], kv_valid[:, :-B]
    return logits, cache_blk, cache_valid


@torch.no_grad()
def diffusion_decode_independent(model, prompts, max_new_tokens, block_size, mask_token_id, eos_token_id,
                                 pad_token_id=0, tau=DEFAULT_TAU, temperature=0.0, max_steps_per_block=None,
                                 generator=None, commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False):
    """diffusion_decode's contract (arguments, commit rules, EOS hold, DiffusionResult), rows advancing
    independently. Returns a DiffusionResult."""
    dev, B = model.device, block_size
    cap = max_steps_per_block or B
    check_commit_rule(commit_rule)
    ids, plen = left_pad(prompts, pad_token_id)
    ids, plen = ids.to(dev), plen.to(dev)
    b, P = ids.shape
    pre = P - 1
    t0 = clock(dev)
    cache, blk, cache_valid, n_forward = prefill(model, ids, plen)
    prefill_seconds = clock(dev) - t0
    cache_blk = blk[None].expand(b, -1)
    n_blocks = math.ceil(max_new_tokens / B)
    arange_b = torch.arange(B, device=dev)
    traj_tok = torch.full((b, n_blocks * B), mask_token_id, dtype=torch.long, device=dev)
    traj_step = torch.full_like(traj_tok, -1)
    traj_lp = torch.zeros(b, n_blocks * B, device=dev)
    length = torch.zeros(b, dtype=torch.long, device=dev)
    steps_per_block = [[] for _ in range(b)]
    # per active row: original index, last known token, left padding, block, step within the block
    rows, last, pad_left = torch.arange(b, device=dev), ids[:, -1], P - plen
    k = torch.zeros(b, dtype=torch.long, device=dev)
    s = torch.zeros(b, dtype=torch.long, device=dev)
    canvas = torch.full((b, B), mask_token_id, dtype=torch.long, device=dev)
    step_of = torch.full_like(canvas, -1)
    lp_blk = torch.zeros(b, B, device=dev)
    pending, n_steps, column_rows, clean_column_rows = None, 0, 0, 0
    while len(rows):
        limit = (max_new_tokens - k * B).clamp(max=B)
        stop = torch.minimum(_first_eos(canvas, step_of, eos_token_id), limit)
        eligible = (step_of < 0) & (arange_b[None] < stop[:, None])
        lo, hi = needed_columns(eligible)  # every active row has a masked column (finished rows moved on)
        win_pos = pre + k[:, None] * B + arange_b[None] - pad_left[:, None]
        window = torch.cat([last[:, None], canvas[:, :-1]], 1)
        logits, cache_blk, cache_valid = ragged_block_step(model, cache, cache_blk, cache_valid, window, win_pos,
                                                           pre + k, pending, keep=arange_b[lo:hi])
        column_rows += window.numel()
        if pending is not None:
            clean_column_rows += pending[0].numel()
        pending = None
        n_forward, n_steps = n_forward + 1, n_steps + 1
        commit, tok, lp = choose_commits(logits, eligible[:, lo:hi], s == cap - 1,  # a row's last allowed step
                                         tau, temperature, generator, commit_rule, eos_token_id if hold_eos else None)
        canvas[:, lo:hi] = torch.where(commit, tok, canvas[:, lo:hi])
        step_of[:, lo:hi] = torch.where(commit, s[:, None], step_of[:, lo:hi])
        lp_blk[:, lo:hi] = torch.where(commit, lp, lp_blk[:, lo:hi])
        s = s + 1
        eos = _first_eos(canvas, step_of, eos_token_id)
        left = (step_of < 0) & (arange_b[None] < torch.minimum(eos, limit)[:, None])
        fin = ~left.any(1)
        if not fin.any():
            continue
        # rows whose block is done: record it, then end the row or start its next block
        f = fin.nonzero().squeeze(1)
        for i, r in zip(f.tolist(), rows[f].tolist()):
            kb = int(k[i])
            traj_tok[r, kb * B:(kb + 1) * B] = canvas[i]
            traj_step[r, kb * B:(kb + 1) * B] = step_of[i]
            traj_lp[r, kb * B:(kb + 1) * B] = lp_blk[i]
            steps_per_block[r].append(int(step_of[i].amax()) + 1)
        has_eos = eos < limit
        length[rows[f]] = (k * B + torch.where(has_eos, eos + 1, limit))[f]
        done = fin & (has_eos | (k + 1 >= n_blocks))
        advance = fin & ~done
        if advance.any():
            pending = (torch.cat([last[:, None], canvas[:, :-1]], 1), win_pos, pre + k, advance)
            last = torch.where(advance, canvas[:, -1], last)
            k = torch.where(advance, k + 1, k)
            s = torch.where(advance, 0, s)
            canvas = torch.where(advance[:, None], mask_token_id, canvas)
            step_of = torch.where(advance[:, None], -1, step_of)
            lp_blk = torch.where(advance[:, None], 0.0, lp_blk)
        if done.any():
            idx = (~done).nonzero().squeeze(1)
            if len(idx) == 0:
                break
            select_rows(cache, idx)
            rows, last, pad_left, k, s, canvas, step_of, lp_blk, cache_blk, cache_valid = (
                x[idx] for x in (rows, last, pad_left, k, s, canvas, step_of, lp_blk, cache_blk, cache_valid))
            if pending is not None:
                pending = tuple(x[idx] for x in pending)
    res = collect_result(traj_tok, traj_step, traj_lp, length, B, n_forward, n_steps, steps_per_block,
                         prefill_seconds)
    res.n_columns = n_steps * B
    # Every block but a row's last is written once; the rest of the clean-write columns were padding
    # (derived here, so the step loop adds no reduction).
    written = B * sum(len(spb) - 1 for spb in steps_per_block)
    res.column_rows, res.padding_column_rows = column_rows + clean_column_rows, clean_column_rows - written
    return res
