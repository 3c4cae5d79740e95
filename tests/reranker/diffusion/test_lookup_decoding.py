"""Prompt-lookup drafting (lookup_decoder.py): the same tokens as greedy ar_decode, in fewer forwards
when the drafts hit."""
import pytest
import torch

from reranker.diffusion import ar_decode
from reranker.diffusion.lookup_decoder import NgramIndex, ar_lookup_decode
from tiny_decoder import PAD, frequent_token, model_for, prompts_for

torch.set_num_threads(1)


def test_ngram_index_drafts_after_the_latest_earlier_longest_match():
    idx = NgramIndex([5, 6, 7, 1, 6, 7, 2, 9, 6, 7], max_ngram=3)
    # suffix (6, 7): its latest earlier occurrence ends at index 6, followed by 2, 9, 6, 7
    assert idx.draft(3) == [2, 9, 6]
    idx.extend([2])
    # the suffix (6, 7, 2) occurred once before, (7, 2) too: the longest match wins
    assert idx.draft(5) == [9, 6, 7, 2]
    assert NgramIndex([1, 2, 3]).draft(4) == []  # the final token never occurred before
    assert NgramIndex([4, 4]).draft(3) == [4]  # a match may run into the suffix itself
    assert idx.draft(0) == []


def repeating_prompts(model, lens):
    """Prompts p + (the model's greedy continuation of p) + p: the model tends to continue the
    repeat, so drafts from the prompt get accepted."""
    base = prompts_for(0, lens)
    cont = ar_decode(model, base, 12, eos_token_id=-1).tokens
    return [p + c + p for p, c in zip(base, cont)]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_lookup_equals_greedy_ar_at_batch_one_and_three(attn):
    model = model_for(attn)
    prompts = repeating_prompts(model, (5, 9, 3))  # 22, 30 and 18 tokens: left padding in the batch
    eos = frequent_token(model, prompts, 40)  # some rows stop early, some run to the budget
    ar = ar_decode(model, prompts, 40, eos_token_id=eos, pad_token_id=PAD)
    assert len({len(t) for t in ar.tokens}) > 1
    batched = ar_lookup_decode(model, prompts, 40, eos, PAD)
    assert batched.tokens == ar.tokens
    assert batched.accepted > 0 and batched.n_forward < max(len(t) for t in ar.tokens)
    for lp, ref in zip(batched.logprobs, ar.logprobs):
        torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
    for p, ref in zip(prompts, ar.tokens):
        one = ar_lookup_decode(model, [p], 40, eos, PAD)
        assert one.tokens == [ref]
        assert one.n_forward <= len(ref)
    # over the three rows, the drafts that hit saved forwards
    assert sum(ar_lookup_decode(model, [p], 40, eos, PAD).n_forward for p in prompts) < sum(map(len, ar.tokens))


def test_lookup_stays_exact_at_every_draft_cap_and_budget():
    model = model_for("sdpa")
    prompts = repeating_prompts(model, (7, 4, 6))
    for L in (1, 2, 17):
        ref = ar_decode(model, prompts, L, eos_token_id=-1).tokens
        for k_max in (1, 2, 16):
            res = ar_lookup_decode(model, prompts, L, -1, k_start=1, k_max=k_max)
            assert res.tokens == ref and all(len(t) == L for t in res.tokens)
            assert res.accepted <= res.drafted
    with pytest.raises(ValueError, match="k_start"):
        ar_lookup_decode(model, prompts, 4, -1, k_start=0)
