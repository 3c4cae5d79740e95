"""Block-diffusion decoding with a KV cache, recording the denoising trajectory for OPD / RL.

Layout (masks.py): prompts left-padded to width P; the prefix z[0:P-1] is prefilled once. Block k
targets y[kB:kB+B]; its input window is (last known token, canvas[0:B-1]) at columns P-1+kB+j,
where uncommitted canvas entries are the mask token; window logit j predicts target j. Each step
runs only that window against the cache, then crops its KVs away (they saw mask tokens). When a
block is finished its CLEAN window (last token of block k-1, y[kB:kB+B-1]) must enter the cache;
that write is fused into the first step of block k+1: the forward runs [clean window k ; noisy
window k+1], the noisy half attends to the clean half (grp 0), the clean half does not see the noisy
half, and only the noisy B columns are cropped. Exact, and it saves one forward per block.

All active rows advance block k together; a row whose block is complete waits (no commits) until
the block ends for every row; rows that hit EOS (or max_new_tokens) are then dropped from the
batch and the cache. After a row's first committed EOS, later positions of that block are no longer
committed (they are discarded), but tokens already committed there stay on the canvas and in the
trajectory, because later commits saw them.
"""
import math
from dataclasses import dataclass

import torch

from reranker.decoding import DEFAULT_COMMIT_RULE, DEFAULT_TAU

from .forward import (check_commit_rule, clock, commit_confident, crop, forward, new_cache, pick_tokens,
                      select_rows)
from .lookup_decoder import DEFAULT_K_MAX, DEFAULT_K_START, NgramIndex
from .masks import block_causal_mask, clean_block_ids, left_pad
from .prompt_prefill import prompt_prefill


@dataclass
class Trajectory:
    """One row's denoising record, indexed by response position (block = position // block_size).
    The canvas block k was at step s = its targets with steps < s (others are the mask token)."""
    tokens: torch.Tensor    # (n_blocks*B,) long; mask token where never committed
    steps: torch.Tensor     # (n_blocks*B,) long; step within the block at commit, -1 if never
    logprobs: torch.Tensor  # (n_blocks*B,) float; log p(token) under softmax(logits / T) at commit
    length: int             # kept tokens: through the first EOS, or up to max_new_tokens
    block_size: int

    @property
    def blocks(self):
        return torch.arange(len(self.tokens)) // self.block_size

    @property
    def committed(self):
        return self.steps >= 0

    @property
    def kept(self):
        return torch.arange(len(self.tokens)) < self.length


@dataclass
class DiffusionResult:
    tokens: list            # per row: generated ids through EOS
    trajectories: list      # per row: Trajectory
    n_forward: int          # model forward passes (prefill included)
    n_steps: int            # block steps run (each one forward over the active rows)
    steps_per_block: list   # per row: steps its blocks needed
    prefill_seconds: float = 0.0  # wall time of the prompt prefill (it yields no token)
    n_columns: int = 0  # noisy window columns run, summed over steps (window / reuse_settled run fewer)
    # Every column each step ran through the model, summed over its rows: noisy windows and clean writes.
    column_rows: int = 0


def prefill(model, ids, plen):
    """Prefill the causal prefix (all prompt columns but the last). Returns (cache, cache_blk
    (cols,), cache_valid (b, cols), n_forward)."""
    b, P = ids.shape
    pre = P - 1
    cache = new_cache(model)
    blk = clean_block_ids(pre, pre, 1, ids.device)
    valid = torch.arange(pre, device=ids.device)[None] >= (P - plen)[:, None]
    if pre == 0:
        return cache, blk, valid, 0
    prompt_prefill(model, ids, plen, pre, cache)
    return cache, blk, valid, 1


def block_step(model, cache, cache_blk, cache_valid, window, window_pos, window_blk, pending=None, keep=None,
               retain=0, hidden=None, mask_memo=None):
    """One denoising step of a noisy window against the cache; returns (logits (b, B, V),
    cache_blk, cache_valid). If `pending` = (ids, pos, blk) of the previous block's clean window is
    given, it is written to the cache in the same forward; the window's own KVs are cropped, all
    but its first `retain` columns (settled columns a later step of the block reuses: see
    diffusion_decode's `reuse_settled`), which stay as clean context of this block.

    keep: window columns (1D long tensor) whose logits are wanted; the logits are then (b, len(keep),
    V). Committed columns (and the clean half of a fused step) never need logits, so the decoder
    asks only for the columns some row still has masked. The vocabulary projection is a fifth of
    this model's per-column FLOPs, but on the Beauty CPU model it made decoding only ~2% faster.
    Every column still runs through the layers: its KVs are what the other columns attend to.

    hidden: optional (b, B) bool, the window columns whose input is a lookup draft (one contiguous
    stretch per row). A draft is a guess, and a column that saw the guesses after it would take them
    for the answer, so no column sees a draft after it, directly or through a later column's KVs;
    each column still sees its own input and the drafts before it.

    mask_memo: optional dict the caller keeps for one block: a step with no pending write and
    nothing retained runs against the same cache as the block's previous such step, so its mask is
    built once and reused (a small model's step is mostly per-op overhead)."""
    b, B = window.shape
    dev = window.device
    ids, pos = window, window_pos
    memo = mask_memo is not None and pending is None and not retain
    mask = mask_memo.get("mask") if memo else None
    if mask is None:
        q_blk, q_grp = torch.full((B,), window_blk, device=dev), torch.ones(B, dtype=torch.long, device=dev)
        if pending is not None:
            p_ids, p_pos, p_blk = pending
            ids, pos = torch.cat([p_ids, ids], 1), torch.cat([p_pos, pos], 1)
            q_blk = torch.cat([torch.full((p_ids.shape[1],), p_blk, device=dev), q_blk])
            q_grp = torch.cat([torch.zeros(p_ids.shape[1], dtype=torch.long, device=dev), q_grp])
        kv_blk = torch.cat([cache_blk, q_blk])
        kv_grp = torch.cat([torch.zeros_like(cache_blk), q_grp])
        kv_valid = torch.cat([cache_valid, torch.ones(b, len(q_blk), dtype=torch.bool, device=dev)], 1)
        mask = block_causal_mask(q_blk, q_grp, kv_blk, kv_grp, kv_valid)
        if memo:
            mask_memo["mask"] = mask
    offset = ids.shape[1] - B  # the noisy window is the last B columns
    keep = torch.arange(B, device=dev) if keep is None else keep.to(dev)
    if hidden is not None:
        mask = mask.clone()  # the memo keeps the plain mask
        # A later key carries a draft when a drafted column lies between the query and it (a key after
        # the drafts saw them in the layer before), so query q sees key k > q only if k is before the
        # row's first drafted column or q is at or after its last: the drafted stretch is causal. One
        # in-place fill per drafted row (a small model's step is mostly per-op overhead).
        later = torch.ones(B, B, dtype=torch.bool, device=dev).triu_(1)  # key after query
        spans: dict[int, list[int]] = {}
        for r, c in hidden.nonzero().tolist():
            spans.setdefault(r, [c, c])[1] = c
        q0, k0 = mask.shape[2] - B, mask.shape[3] - B  # the noisy window's first query and key
        for r, (first, last) in spans.items():
            mask[r, 0, q0:q0 + last, k0 + first:].masked_fill_(later[:last, first:], torch.finfo(mask.dtype).min)
    logits = forward(model, ids, pos, mask, cache, logits_to_keep=keep + offset)
    crop(cache, B - retain)
    if pending is not None or retain:  # then the mask was built here, with kv_blk and kv_valid
        # Retained columns count as clean past of this block's later windows (block id one below).
        kv_blk = torch.cat([kv_blk[:len(kv_blk) - B], torch.full((retain,), window_blk - 1, device=dev)])
        cache_blk, cache_valid = kv_blk, kv_valid[:, :len(kv_blk)]
    return logits, cache_blk, cache_valid


def _first_eos(canvas, step_of, eos_id):
    hit = (canvas == eos_id) & (step_of >= 0)
    B = canvas.shape[1]
    return torch.where(hit.any(1), hit.int().argmax(1), torch.full_like(hit[:, 0], B, dtype=torch.long))


@torch.no_grad()
def diffusion_decode(model, prompts, max_new_tokens, block_size, mask_token_id, eos_token_id,
                     pad_token_id=0, tau=DEFAULT_TAU, temperature=0.0, max_steps_per_block=None, generator=None,
                     commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False, window=None, reuse_settled=False,
                     lookup_drafts=False):
    """Decode block by block; each step commits every masked position with confidence >= tau plus
    the most confident one (greedy if temperature == 0, else sampled from softmax(logits / T);
    confidence = probability of the chosen token), or with commit_rule="prefix" the leftmost masked
    position and the confident run after it (forward.commit_confident). hold_eos: an EOS is
    committed only as the position a step must commit, never on confidence beside others. At step
    max_steps_per_block - 1 (default B) every remaining position is committed. Committed tokens are
    never revised.

    Two approximations that run fewer columns per step (both off by default, which is exact):
    window: a step runs the block's columns only up to `window` past the leftmost masked position
    (the furthest of the batch's rows); masked positions beyond are not in that forward at all.
    reuse_settled: a column whose input token was already committed when the last step ran keeps
    the KVs that step computed, and later steps of the block start after it. Its KVs saw the block
    as it was then (masks where tokens are now), which the exact decoder would recompute.

    lookup_drafts ("prefix" rule only): the masked inputs after a row's leftmost masked position
    hold prompt-lookup drafts instead of the mask token (the tokens that followed the latest earlier
    occurrence of the text's last n-gram, lookup_decoder.NgramIndex), and a drafted position commits
    when the token chosen before it equals its draft (commit_confident's `confirmed`). The answer is
    mostly copied from the prompt; a masked left neighbour is what keeps a copy from being made in
    parallel, and a confirmed draft gives the position the neighbour it would see one step later.
    Drafts cost no column (the step runs the whole window anyway). The trajectory records what was
    committed, not the drafts the model saw, so replay (OPD / RL) does not reproduce such a decode:
    training rollouts decode without drafts."""
    dev, B = model.device, block_size
    cap = max_steps_per_block or B
    check_commit_rule(commit_rule)  # before any forward, not at the first step
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    approximate = window is not None or reuse_settled
    if lookup_drafts and commit_rule != "prefix":
        raise ValueError(f"lookup_drafts needs commit_rule 'prefix', got {commit_rule!r}")
    index = [NgramIndex(p) for p in prompts] if lookup_drafts else None
    draft_len = [DEFAULT_K_START] * len(prompts)  # lookup_drafts: each row's draft length, adapted as ar_lookup's
    ids, plen = left_pad(prompts, pad_token_id)
    ids, plen = ids.to(dev), plen.to(dev)
    b, P = ids.shape
    pre = P - 1
    t0 = clock(dev)
    cache, cache_blk, cache_valid, n_forward = prefill(model, ids, plen)
    prefill_seconds = clock(dev) - t0
    last, pad_left = ids[:, -1], P - plen
    rows = torch.arange(b, device=dev)
    n_blocks = math.ceil(max_new_tokens / B)
    traj_tok = torch.full((b, n_blocks * B), mask_token_id, dtype=torch.long, device=dev)
    traj_step = torch.full_like(traj_tok, -1)
    traj_lp = torch.zeros(b, n_blocks * B, device=dev)
    length = torch.zeros(b, dtype=torch.long, device=dev)
    steps_per_block = [[] for _ in range(b)]
    arange_b = torch.arange(B, device=dev)
    pending, n_steps, n_columns, column_rows = None, 0, 0, 0
    for k in range(n_blocks):
        nb = len(rows)
        canvas = torch.full((nb, B), mask_token_id, dtype=torch.long, device=dev)
        step_of = torch.full_like(canvas, -1)
        lp_blk = torch.zeros(nb, B, device=dev)
        limit = min(B, max_new_tokens - k * B)
        win_pos = (pre + k * B + arange_b)[None] - pad_left[:, None]
        start = 0  # block columns already in the cache (reuse_settled), so not run again
        done = [0] * nb  # lookup_drafts: each row's committed run in this block (the prefix rule's)
        row_ids = rows.tolist()
        mask_memo = None if approximate else {}  # this block's steps after its first share one mask
        for s in range(cap):
            stop = _first_eos(canvas, step_of, eos_token_id).clamp(max=limit)  # nothing past EOS / budget
            eligible = (step_of < 0) & (arange_b[None] < stop[:, None])
            last_step = s == cap - 1
            end, settle = B, start  # the exact step: every column, nothing kept
            if approximate:
                leftmost = torch.where(eligible.any(1), eligible.int().argmax(1), torch.full_like(stop, B))
                if window is not None and not last_step:
                    end = min(B, int(leftmost.max()) + window)
                # Settled: columns before every row's leftmost masked position. Their targets and their
                # inputs (column j reads canvas[j-1]) are committed, so this step's KVs of them are kept.
                if reuse_settled:
                    settle = min(int(leftmost.min()), end)
            # The window columns some row still needs. Every row's leftmost masked position lies
            # inside the window, so none means the block is done.
            need = needed_columns(eligible[:, start:end])
            if need is None:
                break
            cut = slice(start + need[0], start + need[1])
            window_in = torch.cat([last[:, None], canvas[:, :-1]], 1)
            drafted = None
            if lookup_drafts:
                window_in, drafted, n_drafted = draft_inputs(window_in, done, [index[r] for r in row_ids],
                                                             [draft_len[r] for r in row_ids])
            window_ids = window_in[:, start:end]
            logits, cache_blk, cache_valid = block_step(model, cache, cache_blk, cache_valid, window_ids,
                                                        win_pos[:, start:end], pre + k, pending,
                                                        keep=arange_b[need[0]:need[1]],
                                                        retain=settle - start, mask_memo=mask_memo,
                                                        hidden=None if drafted is None else drafted[:, start:end])
            column_rows += window_ids.numel() + (0 if pending is None else pending[0].numel())
            pending = None
            n_forward, n_steps = n_forward + 1, n_steps + 1
            n_columns += end - start
            commit, tok, lp = choose_commits(logits, eligible[:, cut], last_step, tau, temperature, generator,
                                             commit_rule, eos_token_id if hold_eos else None,
                                             None if drafted is None else drafted[:, cut], window_in[:, cut])
            canvas[:, cut] = torch.where(commit, tok, canvas[:, cut])
            step_of[:, cut].masked_fill_(commit, s)
            lp_blk[:, cut] = torch.where(commit, lp, lp_blk[:, cut])
            if lookup_drafts:  # the committed run grows the text the next drafts are looked up in
                rows_now = torch.cat([canvas, (step_of >= 0).sum(1, keepdim=True)], 1).tolist()
                for i, r in enumerate(row_ids):
                    n = rows_now[i][-1]
                    index[r].extend(rows_now[i][done[i]:n])
                    if n_drafted[i]:  # kept whole: draft one further; cut: halve (a wrong draft stops the run)
                        whole = n - done[i] > n_drafted[i]
                        draft_len[r] = min(draft_len[r] + 1, DEFAULT_K_MAX) if whole else max(draft_len[r] // 2, 1)
                    done[i] = n
            start = settle
        if start:  # the block's reused columns leave the cache: its clean window is written next
            crop(cache, start)
            cache_blk, cache_valid = cache_blk[:-start], cache_valid[:, :-start]
        traj_tok[rows, k * B:(k + 1) * B] = canvas
        traj_step[rows, k * B:(k + 1) * B] = step_of
        traj_lp[rows, k * B:(k + 1) * B] = lp_blk
        eos = _first_eos(canvas, step_of, eos_token_id)
        has_eos = eos < limit
        length[rows] = k * B + torch.where(has_eos, eos + 1, torch.full_like(eos, limit))
        for r, m in zip(rows.tolist(), (step_of.amax(1) + 1).tolist()):
            steps_per_block[r].append(m)
        keep = ~has_eos if k + 1 < n_blocks else torch.zeros_like(has_eos)
        if not keep.any():
            break
        pending_ids = torch.cat([last[:, None], canvas[:, :-1]], 1)
        last = canvas[:, -1]
        if not keep.all():
            idx = keep.nonzero().squeeze(1)
            select_rows(cache, idx)
            rows, last, pad_left, cache_valid, pending_ids, win_pos = (
                x[idx] for x in (rows, last, pad_left, cache_valid, pending_ids, win_pos))
        pending = (pending_ids, win_pos, pre + k)
    res = collect_result(traj_tok, traj_step, traj_lp, length, B, n_forward, n_steps, steps_per_block,
                         prefill_seconds)
    res.n_columns, res.column_rows = n_columns, column_rows
    return res


def draft_inputs(window_in, done, indexes, lengths):
    """The window's inputs with lookup drafts: for each row, up to lengths[i] tokens continuing its
    text (prompt and committed answer) fill the inputs after its leftmost masked position (column j
    reads the token at j - 1, so the draft of position done + i is the input of column done + 1 + i).
    The inputs after a draft keep the mask token, so the plain rule commits there on confidence.
    Returns (inputs, drafted, n_drafted): drafted (b, B) marks the columns whose input is a draft,
    or is None when no row found one (the step is then the plain one)."""
    b, B = window_in.shape
    found = [ix.draft(min(k, B - 1 - n)) for n, ix, k in zip(done, indexes, lengths)]
    n_drafted = [len(d) for d in found]
    if not any(n_drafted):
        return window_in, None, n_drafted
    drafts = torch.full((b, B), -1, dtype=torch.long)
    for i, (n, d) in enumerate(zip(done, found)):
        drafts[i, n + 1:n + 1 + len(d)] = torch.tensor(d, dtype=torch.long)
    drafts = drafts.to(window_in.device)
    drafted = drafts >= 0
    return torch.where(drafted, drafts, window_in), drafted, n_drafted


def needed_columns(eligible):
    """(lo, hi): the block columns from the first that some row still has masked to the last, or
    None when no row has one. A step asks logits for that one range, so every per-column array of
    the step is a slice of the block (a column in between that no row needs gets logits it does not
    use; at batch 1 there is none, and a scatter by index costs more than such a column)."""
    need = eligible.any(0).nonzero()
    if len(need) == 0:
        return None
    return int(need[0]), int(need[-1]) + 1


def choose_commits(logits, eligible, force, tau, temperature, generator, commit_rule, hold_eos_id,
                   drafted=None, inputs=None):
    """One step's choice over the block columns its logits cover (the caller cuts eligible,
    drafted and inputs to those columns, needed_columns): a token per column, and which eligible
    positions commit. force: commit every eligible position (a bool, or per row (b,)); hold_eos_id:
    the EOS id to hold (commit_confident's `hold`), or None; drafted / inputs: the columns whose
    input was a lookup draft and the window's inputs (draft_inputs), or None. Returns (commit,
    tokens, logprobs), each (b, columns)."""
    tok, lp, conf = pick_tokens(logits, temperature, generator=generator)
    hold = tok == hold_eos_id if hold_eos_id is not None else None  # commit_confident only looks at eligible ones
    confirmed = None
    if drafted is not None:  # column j's draft is confirmed when it is the token chosen at j - 1
        # (the first column is never drafted: drafts start after a row's leftmost masked position)
        confirmed = torch.zeros_like(drafted)
        confirmed[:, 1:] = drafted[:, 1:] & (inputs[:, 1:] == tok[:, :-1])
    if isinstance(force, bool):
        return commit_confident(conf, eligible, tau, force_all=force, rule=commit_rule, hold=hold, drafted=drafted,
                                confirmed=confirmed), tok, lp
    commit = commit_confident(conf, eligible, tau, rule=commit_rule, hold=hold, drafted=drafted, confirmed=confirmed)
    return torch.where(force[:, None], eligible, commit), tok, lp


def collect_result(traj_tok, traj_step, traj_lp, length, B, n_forward, n_steps, steps_per_block,
                   prefill_seconds) -> DiffusionResult:
    """The per-row record of a decode: tokens through each row's length, and its trajectory in whole blocks."""
    trajs, tokens = [], []
    for r in range(len(length)):
        n = int(length[r])
        end = math.ceil(n / B) * B
        tokens.append(traj_tok[r, :n].tolist())
        trajs.append(Trajectory(traj_tok[r, :end].cpu(), traj_step[r, :end].cpu(), traj_lp[r, :end].cpu(), n, B))
    return DiffusionResult(tokens, trajs, n_forward, n_steps, steps_per_block, prefill_seconds)
