"""The one prompt prefill of every decoder: a batch without padding runs causal attention with no
mask, a padded batch runs row by row (no padding columns, no mask), and both give the logits and
keys of the padded forward under the explicit block-causal mask: each row what it gets alone."""
import contextlib
import functools

import pytest
import torch

from reranker.diffusion.forward import compute_precision, forward, new_cache
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
    with torch.no_grad():
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


def _assert_same_prefill(got_logits, cache, want_logits, want_cache, pad, tol=1e-5):
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)
    for a, b in zip(cache.layers, want_cache.layers):
        assert a.keys.shape == b.keys.shape and a.keys.dtype == b.keys.dtype and a.values.dtype == b.values.dtype
        for r, p in enumerate(pad):  # the prompt's columns; pad columns are zero, which every decoder masks
            torch.testing.assert_close(a.keys[r, :, p:], b.keys[r, :, p:], rtol=tol, atol=tol)
            torch.testing.assert_close(a.values[r, :, p:], b.values[r, :, p:], rtol=tol, atol=tol)
            assert not a.keys[r, :, :p].any() and not a.values[r, :, :p].any()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("inside_a_decode", [False, True])
@pytest.mark.parametrize("lens", [(9,), (5, 9, 2, 7)])
@pytest.mark.parametrize("all_but_last", [False, True])  # AR prefills every prompt column, diffusion all but the last
def test_a_prefill_passes_no_mask_and_gives_the_masked_prefills_values(impl, inside_a_decode, lens, all_but_last,
                                                                       monkeypatch):
    model = model_for(impl)
    ids, plen = left_pad(prompts_for(1, lens=lens), 0)
    n_cols = ids.shape[1] - all_but_last
    want, want_cache = _masked_prefill(model, ids, plen, n_cols)  # outside any packed scope: eager is eager
    seen = _spy_masks(model, monkeypatch)
    with torch.no_grad(), (packed_rows_attention(model) if inside_a_decode else contextlib.nullcontext()):
        cache = new_cache(model)
        logits = prompt_prefill(model, ids, plen, n_cols, cache)
    # no mask: one forward for a batch without padding, else one forward per row
    assert seen == [None] * (1 if len(lens) == 1 else len(lens))
    assert model.config._attn_implementation == impl
    _assert_same_prefill(logits, cache, want, want_cache, (ids.shape[1] - plen).tolist())


def test_a_bfloat16_prefill_keeps_the_caches_dtypes_and_values():
    """Under autocast, keys reach the cache in float32 (after the key norm) and values in bfloat16:
    rows written one by one keep the dtypes and values the masked forward's cache holds."""
    model = model_for("sdpa")
    ids, plen = left_pad(prompts_for(1, lens=(5, 9, 2, 7)), 0)
    with compute_precision(model.device, "bfloat16"):
        want, want_cache = _masked_prefill(model, ids, plen, ids.shape[1])
        with torch.no_grad():
            cache = new_cache(model)
            logits = prompt_prefill(model, ids, plen, ids.shape[1], cache)
    _assert_same_prefill(logits, cache, want, want_cache, (ids.shape[1] - plen).tolist(), tol=2e-2)


def test_a_diffusion_prefill_with_a_one_token_prompt_keeps_the_masked_forward(monkeypatch):
    """Diffusion prefills all columns but the last: a one-token prompt has none, so the batch runs
    the padded forward under the mask."""
    model = model_for("sdpa")
    ids, plen = left_pad(prompts_for(2, lens=(5, 1, 8)), 0)
    want, want_cache = _masked_prefill(model, ids, plen, ids.shape[1] - 1)
    seen = _spy_masks(model, monkeypatch)
    with torch.no_grad():
        cache = new_cache(model)
        logits = prompt_prefill(model, ids, plen, ids.shape[1] - 1, cache)
    assert len(seen) == 1 and seen[0] is not None
    torch.testing.assert_close(logits, want)


def test_a_prefill_stays_causal_when_another_decode_leaves_its_packed_scope_midway():
    """The service decodes on several threads over one model. Hugging Face builds the mask once a
    forward but picks the attention function in every layer: if another decode set an eager model
    back while a prefill with no mask was between the two, its attention would see later keys. The
    prefill holds its own packed scope for that reason."""
    model = model_for("eager")
    ids, plen = left_pad(prompts_for(1, lens=(9,)), 0)
    want, _ = _masked_prefill(model, ids, plen, 9)
    other = packed_rows_attention(model)
    other.__enter__()  # a decode on another thread, which leaves during the prefill's first layer

    def leave(module, args):
        other.__exit__(None, None, None)

    hook = model.model.layers[0].register_forward_pre_hook(leave)
    try:
        with torch.no_grad():
            got = prompt_prefill(model, ids, plen, 9, new_cache(model))
    finally:
        hook.remove()
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_cache_that_holds_columns_is_refused():
    model = model_for("sdpa")
    ids, plen = left_pad(prompts_for(1, lens=(6,)), 0)
    cache = new_cache(model)
    with torch.no_grad():
        prompt_prefill(model, ids, plen, 6, cache)
        with pytest.raises(ValueError, match="empty cache; this one holds 6 columns"):
            prompt_prefill(model, ids, plen, 6, cache)
