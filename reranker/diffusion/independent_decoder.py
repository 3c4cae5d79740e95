"""Block diffusion in a batch whose rows move through their blocks independently.

The lockstep decoder (diffusion_decoder.py) advances every row through block k together: a row
whose block is done after 2 steps waits while another takes 6, so a batch costs its slowest row's
steps in every block. Here each row keeps its own block index and step count, and a row that
finishes a block starts the next one at the very next forward. One forward then serves rows in
different blocks; what makes that exact is that the mask only ever asks "is this key a clean column
of an earlier block of my row, or my own window?" (masks.py), and block and validity ids are kept
per row.

A row entering a new block writes its finished block's clean window into the cache in the same
forward as its first noisy window (as the lockstep decoder does). The other rows have nothing to
write, so a rectangular (b, 2B) input would run B padding columns for each of them; the step is
packed instead (packed_rows.py): one sequence of every row's noisy window and the writing rows'
clean windows, attention per row against caches whose lengths now differ from row to row. Greedy
decoding gives each row the tokens it gets decoded alone (a test), and the same trajectory record,
so OPD and RL can replay it. Sampled decoding draws in another order than the lockstep decoder,
so the two agree in distribution there, not draw for draw.
"""
import math

import torch

from reranker.decoding import DEFAULT_COMMIT_RULE, DEFAULT_TAU

from .diffusion_decoder import _first_eos, choose_commits, collect_result, needed_columns, prefill
from .forward import check_commit_rule, clock, forward, select_rows
from .masks import left_pad
from .packed_rows import PackedRows, packed_rows_attention


def packed_block_step(model, cache, lens, pad_left, window, window_pos, pending=None, keep=None):
    """One denoising step for rows in different blocks, packed (packed_rows.py). lens: (b,) each
    row's cache length; pad_left: (b,) its prompt's left padding (invalid cache columns).
    pending = (ids, pos, has (b,) bool): the clean window of the block a row just finished, written to
    the cache in this forward where `has`. The noisy windows' keys go past each row's length and are
    dropped by not counting them; a written clean window is counted, here (`lens` changes in place).
    Returns logits (b, len(keep), V).

    The mask needs no block ids: a row's cache holds only clean columns of its earlier blocks (its
    prompt, then finished blocks; packed rows write no padding), so masks.py's rule reduces to "every
    valid column of the row up to the end of my own window": a clean window's queries see its row's
    cache and itself, a noisy window's see those and itself, and nothing sees a noisy window but
    itself, because it lies past everything else the row holds."""
    b, B = window.shape
    dev = window.device
    arange_b = torch.arange(B, device=dev)
    keep = arange_b if keep is None else keep.to(dev)
    if pending is not None and not bool(pending[2].any()):  # its rows left the batch
        pending = None
    ids, pos = window.reshape(-1), window_pos.reshape(-1)
    start = lens  # where each row's noisy window goes: after its clean window when it writes one
    if pending is not None:
        p_ids, p_pos, has = pending
        writers = has.nonzero().squeeze(1)
        start = lens + B * has
        ids, pos = torch.cat([ids, p_ids[writers].reshape(-1)]), torch.cat([pos, p_pos[writers].reshape(-1)])
    rows = torch.arange(b, device=dev).repeat_interleave(B)
    cols = start[rows] + arange_b.repeat(b)
    kv_len = int((start + B).max())
    col = torch.arange(kv_len, device=dev)[None]
    seen = col >= pad_left[:, None]
    mask = (seen & (col < (start + B)[:, None]))[:, None].expand(-1, B, -1)  # the noisy windows' queries
    if pending is not None:
        w_rows = writers.repeat_interleave(B)
        rows, cols = torch.cat([rows, w_rows]), torch.cat([cols, lens[w_rows] + arange_b.repeat(len(writers))])
        clean = (seen[writers] & (col < (lens[writers] + B)[:, None]))[:, None].expand(-1, B, -1)
        mask = torch.cat([mask, clean])  # then the clean windows' queries
    plan = PackedRows(cache, b, B, rows, cols, None if pending is None else writers, kv_len)
    keep_at = (torch.arange(b, device=dev)[:, None] * B + keep[None]).reshape(-1)
    logits = forward(model, ids[None], pos[None], mask[:, None], logits_to_keep=keep_at, packed_rows=plan)
    if pending is not None:
        lens += B * has
    return logits.view(b, len(keep), -1)


@torch.no_grad()
def diffusion_decode_independent(model, prompts, max_new_tokens, block_size, mask_token_id, eos_token_id,
                                 pad_token_id=0, tau=DEFAULT_TAU, temperature=0.0, max_steps_per_block=None,
                                 generator=None, commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False):
    """diffusion_decode's contract (arguments, commit rules, EOS hold, DiffusionResult), rows advancing
    independently. Returns a DiffusionResult."""
    with packed_rows_attention(model):
        return _decode_independent(model, prompts, max_new_tokens, block_size, mask_token_id, eos_token_id,
                                   pad_token_id, tau, temperature, max_steps_per_block, generator, commit_rule,
                                   hold_eos)


def _decode_independent(model, prompts, max_new_tokens, block_size, mask_token_id, eos_token_id, pad_token_id, tau,
                        temperature, max_steps_per_block, generator, commit_rule, hold_eos):
    dev, B = model.device, block_size
    cap = max_steps_per_block or B
    check_commit_rule(commit_rule)
    ids, plen = left_pad(prompts, pad_token_id)
    ids, plen = ids.to(dev), plen.to(dev)
    b, P = ids.shape
    pre = P - 1
    t0 = clock(dev)
    cache, _, _, n_forward = prefill(model, ids, plen)
    prefill_seconds = clock(dev) - t0
    n_blocks = math.ceil(max_new_tokens / B)
    lens = torch.full((b,), pre, dtype=torch.long, device=dev)  # each row's cache columns
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
    pending, n_steps = None, 0
    while len(rows):
        limit = (max_new_tokens - k * B).clamp(max=B)
        stop = torch.minimum(_first_eos(canvas, step_of, eos_token_id), limit)
        eligible = (step_of < 0) & (arange_b[None] < stop[:, None])
        lo, hi = needed_columns(eligible)  # every active row has a masked column (finished rows moved on)
        win_pos = pre + k[:, None] * B + arange_b[None] - pad_left[:, None]
        window = torch.cat([last[:, None], canvas[:, :-1]], 1)
        logits = packed_block_step(model, cache, lens, pad_left, window, win_pos, pending, keep=arange_b[lo:hi])
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
            pending = (torch.cat([last[:, None], canvas[:, :-1]], 1), win_pos, advance)
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
            rows, last, pad_left, k, s, canvas, step_of, lp_blk, lens = (
                x[idx] for x in (rows, last, pad_left, k, s, canvas, step_of, lp_blk, lens))
            if pending is not None:
                pending = tuple(x[idx] for x in pending)
    res = collect_result(traj_tok, traj_step, traj_lp, length, B, n_forward, n_steps, steps_per_block,
                         prefill_seconds)
    res.n_columns = n_steps * B
    # B columns a row and step, and B more per block written (every block but a row's last): packed
    # steps run no padding, so the count is derived here rather than summed on the decode path
    res.column_rows = B * sum(sum(spb) + len(spb) - 1 for spb in steps_per_block)
    return res
