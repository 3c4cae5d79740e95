"""The one prompt prefill of every decoder: a batch without padding runs the model's own causal
attention (no mask), with the logits and keys of the explicit block-causal mask; a padded batch
masks its pad keys, so each row's keys are those it gets alone."""
import functools

import pytest
import torch

from reranker.diffusion.forward import forward, new_cache, prompt_prefill
from reranker.diffusion.masks import block_causal_mask, left_pad
from reranker.diffusion.packed_rows import packed_rows_attention
from tiny_decoder import model_for, prompts_for

torch.set_num_threads(1)


def _masked_prefill(model, ids, n):
    blk = torch.arange(n)
    cache = new_cache(model)
    logits = forward(model, ids[:, :n], blk[None], block_causal_mask(blk, torch.zeros_like(blk), blk,
                                                                    torch.zeros_like(blk)), cache)
    return logits, cache


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("packed_scope", [False, True])
def test_an_unpadded_prefill_passes_no_mask_and_matches_the_masked_one(impl, packed_scope, monkeypatch):
    model = model_for(impl)
    ids, plen = left_pad(prompts_for(1, lens=(9,)), 0)
    seen = []
    real = type(model).forward

    @functools.wraps(real)  # the same signature: forward() looks up the cache argument's name in it
    def spy(self, **kw):
        seen.append(kw["attention_mask"])
        return real(self, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    with torch.no_grad(), (packed_rows_attention(model) if packed_scope else torch.no_grad()):
        cache = new_cache(model)
        got = prompt_prefill(model, ids, plen, 8, cache, logits_to_keep=0)
        want, want_cache = _masked_prefill(model, ids, 8)
    assert seen[0] is None and seen[1] is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(cache.layers, want_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_a_padded_prefill_gives_each_row_the_keys_it_gets_alone():
    model = model_for("sdpa")
    prompts = prompts_for(2, lens=(5, 9))
    ids, plen = left_pad(prompts, 0)
    with torch.no_grad():
        cache = new_cache(model)
        logits = prompt_prefill(model, ids, plen, 9, cache)
        for r, p in enumerate(prompts):
            one, one_plen = left_pad([p], 0)
            alone = new_cache(model)
            want = prompt_prefill(model, one, one_plen, len(p), alone)
            torch.testing.assert_close(logits[r], want[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cache.layers[0].keys[r, :, 9 - len(p):], alone.layers[0].keys[0],
                                       rtol=1e-4, atol=1e-5)
