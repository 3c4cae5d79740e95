"""AR decoder == HF generate; block diffusion with B = 1 == AR; cached block step == training mask."""
import pytest
import torch

from reranker.diffusion import ar_decode, commit_confident, diffusion_decode
from reranker.diffusion.diffusion_decoder import block_step, prefill
from reranker.diffusion.forward import forward
from reranker.diffusion.masks import diffusion_training_mask, left_pad
from tiny_decoder import EOS, MASK, PAD, frequent_token, model_for, prompts_for

torch.set_num_threads(1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_ar_greedy_matches_generate(attn):
    model, prompts = model_for(attn), prompts_for()
    eos = frequent_token(model, prompts)
    res = ar_decode(model, prompts, 16, eos_token_id=eos, pad_token_id=PAD)
    ids, plen = left_pad(prompts, PAD)
    attn_mask = (torch.arange(ids.shape[1])[None] >= (ids.shape[1] - plen)[:, None]).long()
    gen = model.generate(input_ids=ids, attention_mask=attn_mask, do_sample=False, max_new_tokens=16,
                         pad_token_id=PAD, eos_token_id=eos)[:, ids.shape[1]:]
    assert any(len(t) < 16 for t in res.tokens)  # EOS did stop some row
    for row, ref in zip(res.tokens, gen.tolist()):
        assert row == ref[:len(row)]
        assert row[-1] == eos or len(row) == 16
    assert all(len(lp) == len(t) and (lp <= 0).all() for lp, t in zip(res.logprobs, res.tokens))


def test_ar_sampling_is_seeded():
    model, prompts = model_for("sdpa"), prompts_for()
    a = ar_decode(model, prompts, 8, EOS, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(5))
    b = ar_decode(model, prompts, 8, EOS, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(5))
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_block_size_one_reproduces_ar(attn):
    model, prompts = model_for(attn), prompts_for(1)
    eos = frequent_token(model, prompts)
    ar = ar_decode(model, prompts, 14, eos_token_id=eos)
    dd = diffusion_decode(model, prompts, 14, 1, MASK, eos, tau=0.9)
    assert dd.tokens == ar.tokens
    for tr, lp in zip(dd.trajectories, ar.logprobs):
        torch.testing.assert_close(tr.logprobs[:tr.length], lp, atol=1e-5, rtol=0)
        assert (tr.steps[:tr.length] == 0).all()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_cached_block_step_equals_training_forward(attn):
    """Prefill + (fused) clean-window writes + one noisy step == the [clean ; noisy] training forward,
    also when only some columns' logits are asked for."""
    model = model_for(attn)
    B, n = 4, 3
    prompts = prompts_for(2, (6, 3))
    g = torch.Generator().manual_seed(3)
    y = torch.randint(3, MASK, (2, n * B), generator=g)
    hide = torch.rand(2, n * B, generator=g) < 0.5
    ids, plen = left_pad(prompts, PAD)
    P = ids.shape[1]
    clean = torch.cat([ids, y[:, :-1]], 1)
    noisy = clean[:, P - 1:].clone()
    noisy[hide & (torch.arange(n * B) % B != 0)] = MASK
    mask, pos = diffusion_training_mask(plen, torch.tensor([n * B] * 2), B, 1)
    with torch.no_grad():
        ref = forward(model, torch.cat([clean, noisy], 1), pos, mask)[:, P - 1 + n * B:]
        cache, cblk, cvalid, _ = prefill(model, ids, plen)
        pending = None
        for k in range(n):
            wpos = pos[:, P - 1 + k * B:P - 1 + (k + 1) * B]
            # blocks 1 and 2 (fused with the clean write) ask for some columns' logits only
            keep = None if k == 0 else torch.tensor([1, 3] if k == 1 else [2])
            logits, cblk, cvalid = block_step(model, cache, cblk, cvalid, noisy[:, k * B:(k + 1) * B], wpos,
                                              P - 1 + k, pending, keep=keep)
            want = ref[:, k * B:(k + 1) * B]
            torch.testing.assert_close(logits, want if keep is None else want[:, keep], atol=1e-5, rtol=0)
            pending = (clean[:, P - 1 + k * B:P - 1 + (k + 1) * B], wpos, P - 1 + k)
            assert cache.get_seq_length() == P - 1 + k * B


def test_commit_confident():
    conf = torch.tensor([[0.95, 0.2, 0.91, 0.5], [0.1, 0.3, 0.2, 0.99], [0.5, 0.6, 0.7, 0.8]])
    elig = torch.tensor([[True, True, True, True], [True, True, True, False], [False] * 4])
    out = commit_confident(conf, elig, 0.9)
    assert out.tolist() == [[True, False, True, False], [False, True, False, False], [False] * 4]
    assert commit_confident(conf, elig, 0.9, force_all=True).tolist() == elig.tolist()


def test_diffusion_decoder_bookkeeping():
    model, prompts = model_for("sdpa"), prompts_for(4)
    eos = frequent_token(model, prompts)
    B, max_new = 4, 15
    res = diffusion_decode(model, prompts, max_new, B, MASK, eos, tau=1.1)  # tau > 1: one commit per step
    assert all(s == min(B, max_new - i * B) for spb in res.steps_per_block for i, s in enumerate(spb)
               if i < len(spb) - 1)
    for toks, tr in zip(res.tokens, res.trajectories):
        assert len(toks) == tr.length <= max_new and (toks[-1] == eos or len(toks) == max_new)
        assert eos not in toks[:-1]
        assert torch.equal(tr.tokens[:tr.length], torch.tensor(toks))
        assert tr.committed[:tr.length].all() and len(tr.tokens) % B == 0
        for k in range(len(tr.tokens) // B):  # one commit per step: steps form a permutation prefix
            st = tr.steps[k * B:(k + 1) * B]
            assert sorted(st[st >= 0].tolist()) == list(range(int((st >= 0).sum())))
    assert res.n_forward == 1 + res.n_steps
    capped = diffusion_decode(model, prompts, max_new, B, MASK, eos, tau=1.1, max_steps_per_block=2)
    assert max(max(s) for s in capped.steps_per_block) <= 2
    sampled = diffusion_decode(model, prompts, max_new, B, MASK, eos, tau=0.5, temperature=1.0,
                               generator=torch.Generator().manual_seed(0))
    again = diffusion_decode(model, prompts, max_new, B, MASK, eos, tau=0.5, temperature=1.0,
                             generator=torch.Generator().manual_seed(0))
    assert sampled.tokens == again.tokens


def test_prefix_commit_rule():
    conf = torch.tensor([[0.5, 0.95, 0.2, 0.99], [0.95, 0.91, 0.3, 0.99], [0.1, 0.2, 0.3, 0.4], [0.2, 0.99, 0.1, 0.9]])
    elig = torch.tensor([[True] * 4, [True] * 4, [False] * 4, [False, True, True, True]])
    out = commit_confident(conf, elig, 0.9, rule="prefix")
    # row 0: the leftmost (unsure) one is forced, then the sure run after it, up to the unsure third;
    # row 1: a sure run from the left; row 3: committed positions do not stop the run (its first is done)
    assert out.tolist() == [[True, True, False, False], [True, True, False, False], [False] * 4,
                            [False, True, False, False]]
    assert commit_confident(conf, elig, 0.9, force_all=True, rule="prefix").tolist() == elig.tolist()
    with pytest.raises(ValueError, match="commit rule"):
        commit_confident(conf, elig, 0.9, rule="left")


def test_held_positions_commit_only_when_a_step_must():
    conf = torch.tensor([[0.5, 0.95, 0.97, 0.99], [0.95, 0.2, 0.97, 0.3]])
    elig = torch.ones(2, 4, dtype=torch.bool)
    hold = torch.tensor([[False, False, True, False], [True, False, True, False]])
    # prefix: a held position stops the confident run unless it is the leftmost (row 1's first)
    out = commit_confident(conf, elig, 0.9, rule="prefix", hold=hold)
    assert out.tolist() == [[True, True, False, False], [True, False, False, False]]
    # confidence: held positions drop out of the sure set but can still be the forced best one
    out = commit_confident(conf, elig, 0.9, hold=hold)
    assert out.tolist() == [[False, True, False, True], [False, False, True, False]]
    assert commit_confident(conf, elig, 0.9, force_all=True, hold=hold).tolist() == elig.tolist()


def _committed_with_eos_before_it(tr, B=4):
    """Was some token before the row's last (EOS) position, in its block, committed in the EOS's step?"""
    end = tr.length - 1
    start = (end // B) * B
    return bool((tr.steps[start:end] == tr.steps[end]).any())


def test_hold_eos_never_ends_a_row_beside_other_commits():
    """With hold_eos and the prefix rule, no token before an ending EOS in its block was committed in
    the EOS's step: the EOS saw its whole left context (checked with a frequent token as EOS, so that rows do end; what
    a step commits after an EOS is discarded). B = 1 is still AR."""
    model, prompts = model_for("sdpa"), prompts_for(4)
    eos = frequent_token(model, prompts)
    ar = ar_decode(model, prompts, 14, eos_token_id=eos)
    assert diffusion_decode(model, prompts, 14, 1, MASK, eos, tau=0.9, commit_rule="prefix",
                            hold_eos=True).tokens == ar.tokens
    for rule in ("prefix",):  # under "confidence" a held EOS can still be a step's one forced commit
        free = diffusion_decode(model, prompts, 16, 4, MASK, eos, tau=0.05, commit_rule=rule)
        held = diffusion_decode(model, prompts, 16, 4, MASK, eos, tau=0.05, commit_rule=rule, hold_eos=True)
        ended = 0
        for tr in held.trajectories:
            if tr.length and int(tr.tokens[tr.length - 1]) == eos and tr.length < 16:
                ended += 1
                assert not _committed_with_eos_before_it(tr), (rule, tr.steps)
        assert ended > 0  # the check above ran
        # without the hold, the low threshold commits an EOS beside tokens before it somewhere
        assert any(_committed_with_eos_before_it(tr) for tr in free.trajectories if tr.length < 16), rule


def test_prefix_rule_commits_left_to_right():
    """Under the prefix rule every block fills left to right (steps never decrease along a block), B = 1
    is still AR, and a threshold above 1 commits one token per step, exactly AR's order."""
    model, prompts = model_for("sdpa"), prompts_for(4)
    eos = frequent_token(model, prompts)
    ar = ar_decode(model, prompts, 14, eos_token_id=eos)
    assert diffusion_decode(model, prompts, 14, 1, MASK, eos, tau=0.9, commit_rule="prefix").tokens == ar.tokens
    one = diffusion_decode(model, prompts, 14, 4, MASK, eos, tau=1.1, commit_rule="prefix")
    for tr in one.trajectories:
        for k in range(len(tr.tokens) // 4):
            st = tr.steps[k * 4:(k + 1) * 4]
            st = st[st >= 0].tolist()
            assert st == list(range(len(st)))
    res = diffusion_decode(model, prompts, 14, 4, MASK, eos, tau=0.3, commit_rule="prefix")
    for tr in res.trajectories:
        for k in range(len(tr.tokens) // 4):
            st = tr.steps[k * 4:(k + 1) * 4]
            st = st[st >= 0].tolist()
            assert st == sorted(st)
    with pytest.raises(ValueError, match="commit rule"):
        diffusion_decode(model, prompts, 4, 4, MASK, eos, commit_rule="nope")
    from reranker.engine import DecodeOptions

    with pytest.raises(ValueError, match="commit_rule: must be one of"):
        DecodeOptions(decoder="diffusion", commit_rule="nope").validate()


WITH_ONE_TOKEN_PROMPT, LONGER_PROMPTS = (5, 9, 1, 7, 3, 11), (5, 9, 2, 7, 3, 11)  # (the prefill's two paths)


@pytest.mark.parametrize("rule,hold,tau,cap,lens", [("confidence", False, 0.3, None, WITH_ONE_TOKEN_PROMPT),
                                                    ("prefix", True, 0.3, None, LONGER_PROMPTS),
                                                    ("prefix", False, 0.6, 2, WITH_ONE_TOKEN_PROMPT),
                                                    ("confidence", True, 1.1, None, LONGER_PROMPTS)])
def test_independent_rows_decode_what_lockstep_decodes(rule, hold, tau, cap, lens):
    """Rows that move through their blocks independently get the tokens, trajectories (the record
    OPD and RL replay) and steps per block of the lockstep decoder, which gives each row what it gets
    alone; with a frequent EOS rows end in different blocks, so rows leave mid-batch. A one-token
    prompt makes the diffusion prefill a masked padded forward; without one it runs row by row."""
    from reranker.diffusion.independent_decoder import diffusion_decode_independent

    model, prompts = model_for("sdpa"), prompts_for(4, lens=lens)
    eos = frequent_token(model, prompts)
    kw = dict(tau=tau, commit_rule=rule, hold_eos=hold, max_steps_per_block=cap)
    lock = diffusion_decode(model, prompts, 19, 4, MASK, eos, **kw)
    ind = diffusion_decode_independent(model, prompts, 19, 4, MASK, eos, **kw)
    assert ind.tokens == lock.tokens
    assert len({len(t) for t in ind.tokens}) > 1  # rows ended at different lengths
    assert ind.steps_per_block == lock.steps_per_block
    for a, b in zip(ind.trajectories, lock.trajectories):
        assert a.length == b.length and torch.equal(a.tokens, b.tokens) and torch.equal(a.steps, b.steps)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    # no row waits: the batch takes as many steps as its slowest row in all, not the slowest per block
    assert ind.n_steps == max(sum(spb) for spb in ind.steps_per_block) <= lock.n_steps
    assert ind.n_forward == 1 + ind.n_steps
    alone = [diffusion_decode_independent(model, [p], 19, 4, MASK, eos, **kw).tokens[0] for p in prompts]
    assert alone == ind.tokens


def _causal_within_blocks(q_blk, q_grp, kv_blk, kv_grp, kv_valid=None, dtype=torch.float32):
    """block_causal_mask, except that no column sees a later column (queries are the last q keys)."""
    from reranker.diffusion.masks import block_causal_mask

    mask = block_causal_mask(q_blk, q_grp, kv_blk, kv_grp, kv_valid, dtype)
    q, kv = mask.shape[-2:]
    later = torch.arange(kv)[None, :] > (torch.arange(q) + kv - q)[:, None]
    return mask.masked_fill(later, torch.finfo(dtype).min)


@pytest.mark.parametrize("rule,tau,window,reuse", [("prefix", 0.3, None, True), ("confidence", 0.3, None, True),
                                                   ("prefix", 1.1, 2, False), ("prefix", 1.1, 3, True)])
def test_window_and_settled_reuse_are_exact_when_no_column_sees_a_later_one(monkeypatch, rule, tau, window, reuse):
    """What `window` and `reuse_settled` leave out is what a column would see of later columns of its
    block. Under a mask where no column sees a later one they must decode exactly what the full step
    decodes (tokens and log-probs), with fewer columns run: this checks their cache bookkeeping
    (kept columns, crops, positions, block ids) across blocks, EOS and dropped rows. The default
    decoder is unchanged by both being off (every other test here)."""
    from reranker.diffusion import diffusion_decoder

    model, prompts = model_for("sdpa"), prompts_for(2)
    eos = frequent_token(model, prompts)
    monkeypatch.setattr(diffusion_decoder, "block_causal_mask", _causal_within_blocks)  # this test only
    full = diffusion_decode(model, prompts, 18, 6, MASK, eos, tau=tau, commit_rule=rule)
    fast = diffusion_decode(model, prompts, 18, 6, MASK, eos, tau=tau, commit_rule=rule, window=window,
                            reuse_settled=reuse)
    assert fast.tokens == full.tokens and fast.steps_per_block == full.steps_per_block
    assert any(len(t) < 18 for t in full.tokens)  # EOS dropped some row
    for a, b in zip(fast.trajectories, full.trajectories):
        assert torch.equal(a.steps, b.steps)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert fast.n_columns < full.n_columns == 6 * full.n_steps
    monkeypatch.undo()
    # Without the patch they are approximations: the same shapes, still a complete decode.
    approx = diffusion_decode(model, prompts, 18, 6, MASK, eos, tau=tau, commit_rule=rule, window=window,
                              reuse_settled=reuse)
    assert [len(t) for t in approx.tokens] and all(tr.committed[:tr.length].all() for tr in approx.trajectories)
    with pytest.raises(ValueError, match="window"):
        diffusion_decode(model, prompts, 4, 4, MASK, eos, window=0)


def test_lookup_drafts_are_speculative_decoding_when_no_column_sees_a_later_one(monkeypatch):
    """With tau > 1 the prefix rule commits one token per step in AR order. Under a mask where no
    column sees a later one, a position whose left neighbour confirmed its draft reads exactly what
    it would read as the next step's leftmost position, so lookup drafts must decode the same tokens
    (and log-probs) in fewer steps whenever a draft is confirmed, and never commit past a draft the
    model did not choose. Prompts that repeat themselves give the lookup something to find."""
    from reranker.diffusion import diffusion_decoder

    model = model_for("sdpa")
    base = prompts_for(3)
    monkeypatch.setattr(diffusion_decoder, "block_causal_mask", _causal_within_blocks)  # this test only
    plain_out = diffusion_decode(model, base, 24, 6, MASK, -1, tau=1.1, commit_rule="prefix").tokens
    # each prompt followed by its own continuation: the continuation of that is often a repeat of it
    prompts = [p + t + p for p, t in zip(base, plain_out)]
    eos = frequent_token(model, prompts)
    plain = diffusion_decode(model, prompts, 24, 6, MASK, eos, tau=1.1, commit_rule="prefix")
    drafted = diffusion_decode(model, prompts, 24, 6, MASK, eos, tau=1.1, commit_rule="prefix", lookup_drafts=True)
    assert drafted.tokens == plain.tokens
    for a, b in zip(drafted.trajectories, plain.trajectories):
        torch.testing.assert_close(a.logprobs[:a.length], b.logprobs[:b.length], atol=1e-5, rtol=0)
    assert drafted.n_steps < plain.n_steps  # some drafts were confirmed
    monkeypatch.undo()
    with pytest.raises(ValueError, match="prefix"):
        diffusion_decode(model, prompts, 4, 4, MASK, eos, commit_rule="confidence", lookup_drafts=True)


def test_an_unconfirmed_draft_stops_the_run():
    """commit_confident with drafts: a drafted position passes only when confirmed, even when the
    model is sure of it, and a confirmed one passes even when unsure."""
    conf = torch.tensor([[0.2, 0.99, 0.1, 0.99, 0.99]])
    eligible = torch.ones(1, 5, dtype=torch.bool)
    drafted = torch.tensor([[False, True, True, True, False]])
    confirmed = torch.tensor([[False, True, True, False, False]])
    got = commit_confident(conf, eligible, 0.9, rule="prefix", drafted=drafted, confirmed=confirmed)
    assert got.tolist() == [[True, True, True, False, False]]
    plain = commit_confident(conf, eligible, 0.9, rule="prefix")
    assert plain.tolist() == [[True, True, False, False, False]]


@torch.no_grad()  # as the decoders run it: their KV cache refuses keys that require grad
def test_hidden_draft_columns_do_not_reach_earlier_columns():
    """block_step's `hidden`: a draft is a guess, so the columns before it must decode as if it were
    any other token; the columns after it do see it."""
    model, prompts = model_for("sdpa"), prompts_for(4)[:2]
    ids, plen = left_pad(prompts, PAD)
    B = 5
    hidden = torch.tensor([[False, False, True, True, False]] * 2)
    logits = []
    for fill in (7, 11):
        cache, blk, valid, _ = prefill(model, ids, plen)
        window = torch.full((2, B), MASK)
        window[:, 0] = ids[:, -1]
        window[:, 2:4] = fill  # the drafted inputs differ between the two runs
        pos = (ids.shape[1] - 1 + torch.arange(B))[None] - (ids.shape[1] - plen)[:, None]
        out, _, _ = block_step(model, cache, blk, valid, window, pos, ids.shape[1] - 1, hidden=hidden)
        logits.append(out)
    torch.testing.assert_close(logits[0][:, :2], logits[1][:, :2])  # before the drafts: unchanged
    assert not torch.allclose(logits[0][:, 4], logits[1][:, 4])  # after them: they are seen


@pytest.mark.parametrize("tau", [0.3, 0.6])
def test_column_counts_account_for_every_column_run(tau):
    """The column-rows a decode reports are its noisy windows (B per row and step) and its clean writes
    (B per finished block that is not a row's last). Rows in different blocks are packed, so the
    rows with nothing to write run no padding columns; lockstep rows run their windows while they
    wait for the batch's slowest row, and a lone row runs the same columns under either schedule."""
    from reranker.diffusion.independent_decoder import diffusion_decode_independent

    B = 4
    model, prompts = model_for("sdpa"), prompts_for(4, lens=(5, 9, 1, 7, 3, 11))
    eos = frequent_token(model, prompts)
    kw = dict(tau=tau, commit_rule="prefix", hold_eos=True)
    ind = diffusion_decode_independent(model, prompts, 19, B, MASK, eos, **kw)
    noisy = B * sum(sum(spb) for spb in ind.steps_per_block)
    clean = B * sum(len(spb) - 1 for spb in ind.steps_per_block)
    assert len({tuple(spb) for spb in ind.steps_per_block}) > 1  # rows fall out of step: some write, others not
    assert ind.column_rows == noisy + clean
    lock = diffusion_decode(model, prompts, 19, B, MASK, eos, **kw)
    assert lock.column_rows > ind.column_rows  # lockstep rows also run their windows while they wait
    for p in prompts[:2]:
        one_ind = diffusion_decode_independent(model, [p], 19, B, MASK, eos, **kw)
        one_lock = diffusion_decode(model, [p], 19, B, MASK, eos, **kw)
        assert one_ind.column_rows == one_lock.column_rows == B * (sum(one_ind.steps_per_block[0])
                                                                   + len(one_ind.steps_per_block[0]) - 1)
