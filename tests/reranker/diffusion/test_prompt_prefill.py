"""The one prompt prefill of every decoder: a batch without padding runs the model's own causal
attention (no mask), a padded batch runs row by row (no padding columns, no mask), and both give the
logits and keys of the padded forward under the explicit block-causal mask, each row what it gets
alone."""
import functools

import pytest
import torch

from reranker.diffusion.forward import forward, new_cache
from reranker.diffusion.masks import block_causal_mask, left_pad, position_ids_for
from reranker.diffusion.packed_rows import packed_rows_attention
from reranker.diffusion.prompt_prefill import prompt_prefill
from tiny_decoder import model_for, prompts_for

torch.set_num_threads(1)


def _masked_prefill(model, ids, plen, n):
    """The reference: the padded forward under the block-causal mask with one-token blocks."""
    blk = torch.arange(n)
    valid = blk[None] >= (ids.shape[1] - plen)[:, None]
    cache = new_cache(model)
    mask = block_causal_mask(blk, torch.zeros_like(blk), blk, torch.zeros_like(blk), valid)
    logits = forward(model, ids[:, :n], position_ids_for(plen, ids.shape[1], n), mask, cache, logits_to_keep=1)
    return logits[:, -1], cache


def _spy_masks(model, monkeypatch):
    seen = []
    real = type(model).forward

    @functools.wraps(real)  # the same signature: forward() looks up the cache argument's name in it
    def spy(self, **kw):
        seen.append(kw["attention_mask"])
        return real(self, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    return seen


def _assert_same_prefill(model, prompts, n_cols, got_logits, cache):
    ids, plen = left_pad(prompts, 0)
    want, want_cache = _masked_prefill(model, ids, plen, n_cols)
    torch.testing.assert_close(got_logits, want, rtol=1e-4, atol=1e-5)
    pad = (ids.shape[1] - plen).tolist()
    for a, b in zip(cache.layers, want_cache.layers):
        assert a.keys.shape == b.keys.shape
        for r, p in enumerate(pad):  # the prompt's columns; pad columns are masked by every decoder
            torch.testing.assert_close(a.keys[r, :, p:], b.keys[r, :, p:], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.values[r, :, p:], b.values[r, :, p:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("packed_scope", [False, True])
@pytest.mark.parametrize("lens", [(9,), (5, 9, 2, 7)])
def test_a_prefill_passes_no_mask_and_gives_the_masked_prefills_values(impl, packed_scope, lens, monkeypatch):
    model = model_for(impl)
    prompts = prompts_for(1, lens=lens)
    ids, plen = left_pad(prompts, 0)
    seen = _spy_masks(model, monkeypatch)
    with torch.no_grad(), (packed_rows_attention(model) if packed_scope else torch.no_grad()):
        cache = new_cache(model)
        logits = prompt_prefill(model, ids, plen, ids.shape[1], cache)
        # no mask: one forward on the kernel's causal path, or a padded batch's rows one by one
        assert seen == [None] * (1 if len(lens) == 1 else len(lens))
        _assert_same_prefill(model, prompts, ids.shape[1], logits, cache)
    assert model.config._attn_implementation == impl


def test_a_diffusion_prefill_with_a_one_token_prompt_keeps_the_masked_forward(monkeypatch):
    """Diffusion prefills all columns but the last: a one-token prompt has none, so the batch is not
    packed; its rows still get their keys."""
    model = model_for("sdpa")
    prompts = prompts_for(2, lens=(5, 1, 8))
    ids, plen = left_pad(prompts, 0)
    seen = _spy_masks(model, monkeypatch)
    with torch.no_grad():
        cache = new_cache(model)
        logits = prompt_prefill(model, ids, plen, ids.shape[1] - 1, cache)
        assert len(seen) == 1 and seen[0] is not None
        _assert_same_prefill(model, prompts, ids.shape[1] - 1, logits, cache)
