"""The in-place KV cache (kv_cache.py) holds what transformers' DynamicCache holds, and every decoder
writes the same tokens with either."""
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import reranker.diffusion.ar_decoder as ar_decoder
import reranker.diffusion.diffusion_decoder as diffusion_decoder
import reranker.diffusion.lookup_decoder as lookup_decoder
from reranker.diffusion import ar_decode, diffusion_decode
from reranker.diffusion.forward import compute_precision, new_cache
from reranker.diffusion.kv_cache import MIN_CAPACITY, InPlaceLayer
from reranker.diffusion.lookup_decoder import ar_lookup_decode
from tiny_decoder import MASK, PAD, frequent_token, model_for, prompts_for

torch.set_num_threads(1)


def test_appends_crops_and_row_selections_match_dynamic_layer():
    """A random run of the operations the decoders use, past the first buffer's capacity."""
    g = torch.Generator().manual_seed(0)
    ours, ref = InPlaceLayer(), DynamicLayer()
    b = 5
    for step in range(60):
        op = torch.randint(0, 4, (), generator=g).item()
        if op == 0 and ref.get_seq_length() > 0:
            n = -torch.randint(1, ref.get_seq_length() + 1, (), generator=g).item()
            ours.crop(n)
            ref.crop(n)
        elif op == 1 and b > 1 and ref.get_seq_length() > 0:
            keep = torch.randperm(b, generator=g)[:b - 1].sort().values
            ours.batch_select_indices(keep)
            ref.batch_select_indices(keep)
            b -= 1
        else:
            q = torch.randint(1, 40, (), generator=g).item()
            # bfloat16 now and then: a float32 step against a bfloat16 cache promotes it, as torch.cat does
            dtype = torch.bfloat16 if step % 7 == 0 else torch.float32  # the first append too
            k, v = (torch.randn(b, 2, q, 3, generator=g).to(dtype) for _ in range(2))
            got, want = ours.update(k, v), ref.update(k, v)
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got, want))
        assert ours.get_seq_length() == ref.get_seq_length()
        if ref.get_seq_length():
            assert ours.keys.dtype == ref.keys.dtype
            assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
    assert ours._key_buf.shape[-2] > MIN_CAPACITY  # the run grew the buffer at least once


def test_refuses_keys_that_require_grad_positive_crops_and_mismatched_shapes():
    layer = InPlaceLayer()
    k = torch.randn(1, 1, 2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        layer.update(k, k)
    layer.update(k.detach(), k.detach())
    with pytest.raises(ValueError, match="negative"):
        layer.crop(1)
    wider = torch.randn(3, 1, 2, 4)  # three rows against a one-row cache: torch.cat would raise too
    with pytest.raises(ValueError, match=r"shape \(3, 1, 2, 4\)"):
        layer.update(wider, wider)


def test_packed_row_writes_land_in_their_rows_and_columns():
    """write_rows puts packed column i at (rows[i], cols[i]) of every layer buffer, leaves the rest,
    grows past the capacity (keeping what every row held) and promotes the dtype as update does."""
    g = torch.Generator().manual_seed(1)
    layer = InPlaceLayer()
    k0 = torch.randn(3, 2, 5, 4, generator=g)
    layer.update(k0, -k0)  # a prefill: 5 columns in each of 3 rows
    want = torch.zeros(3, 2, 200, 4)
    want[:, :, :5] = k0
    lens = torch.tensor([5, 5, 5])
    for step, width in enumerate([(4, 0, 8), (4, 4, 4), (60, 30, 90)]):  # the last one grows the buffer
        rows = torch.cat([torch.full((w,), r) for r, w in enumerate(width)])
        cols = torch.cat([lens[r] + torch.arange(w) for r, w in enumerate(width)])
        dtype = torch.bfloat16 if step == 1 else torch.float32
        new = torch.randn(2, len(rows), 4, generator=g).to(dtype)
        kv_len = int((lens + torch.tensor(width)).max())
        keys, values = layer.write_rows(rows, cols, new, -new, kv_len, 3)
        want[rows, :, cols] = new.float().transpose(0, 1)
        assert keys.shape == (3, 2, kv_len, 4) and keys.dtype == torch.float32  # bfloat16 keys join a float32 cache
        for r in range(3):
            n = int(lens[r]) + width[r]
            assert torch.equal(keys[r, :, :n], want[r, :, :n]) and torch.equal(values[r, :, :n], -want[r, :, :n])
        lens = lens + torch.tensor(width)
    assert layer._key_buf.shape[-2] > MIN_CAPACITY
    # columns no row wrote are zeros, not uninitialised memory: attention multiplies masked values by 0
    # weights, and a NaN there would poison every query of the row
    for r in range(3):
        assert not layer._key_buf[r, :, int(lens[r]):].any() and not layer._value_buf[r, :, int(lens[r]):].any()
    with pytest.raises(RuntimeError, match="no_grad"):
        layer.write_rows(rows, cols, new.float().requires_grad_(), new.float(), kv_len, 3)


def test_the_decoders_cache_is_the_in_place_one_with_a_layer_per_model_layer():
    model = model_for("sdpa")
    cache = new_cache(model)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(isinstance(layer, InPlaceLayer) for layer in cache.layers)


DECODES = {
    "ar": lambda m, p, eos: ar_decode(m, p, 20, eos, PAD),
    "ar_sampled": lambda m, p, eos: ar_decode(m, p, 20, eos, PAD, temperature=0.8, top_p=0.9,
                                              generator=torch.Generator().manual_seed(3)),
    "ar_lookup": lambda m, p, eos: ar_lookup_decode(m, p, 20, eos, PAD),
    "diffusion_confidence": lambda m, p, eos: diffusion_decode(m, p, 20, 4, MASK, eos, PAD, tau=0.5,
                                                               commit_rule="confidence"),
    "diffusion_prefix_hold": lambda m, p, eos: diffusion_decode(m, p, 20, 4, MASK, eos, PAD, tau=0.5,
                                                                commit_rule="prefix", hold_eos=True),
    "diffusion_window_reuse": lambda m, p, eos: diffusion_decode(m, p, 20, 8, MASK, eos, PAD, tau=0.5,
                                                                 commit_rule="prefix", window=3,
                                                                 reuse_settled=True),
    "diffusion_lookup_drafts": lambda m, p, eos: diffusion_decode(m, p, 20, 4, MASK, eos, PAD, tau=0.5,
                                                                  commit_rule="prefix", lookup_drafts=True),
}
# The independent-rows decoder packs its steps into the in-place cache's rows (write_rows), which
# transformers' caches do not offer; test_decoding checks it against the lockstep decoder instead.


def chosen_logprobs(result):
    """Per row, the log-probabilities of the tokens the decoder chose."""
    if hasattr(result, "trajectories"):
        return [tr.logprobs[:tr.length] for tr in result.trajectories]
    return result.logprobs


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(DECODES))
def test_every_decoder_writes_the_same_tokens_with_either_cache(name, precision, monkeypatch):
    """Tokens, forward counts and the chosen tokens' log-probs; bfloat16 decodes run under autocast
    (compute_precision), where keys and values reach the cache in different dtypes. A one-token
    prompt (float32) makes the diffusion prefill a masked padded forward; without one (bfloat16) it
    runs row by row, as AR's always does here."""
    model, prompts = model_for("sdpa"), prompts_for(2, lens=(5, 9, 1, 7) if precision == "float32" else (5, 9, 2, 7))
    eos = frequent_token(model, prompts)
    decode = DECODES[name]
    with compute_precision(model.device, precision):
        ours = decode(model, prompts, eos)
        for module in (ar_decoder, diffusion_decoder, lookup_decoder):  # every module that makes a cache
            monkeypatch.setattr(module, "new_cache", lambda m: DynamicCache(config=m.config))
        ref = decode(model, prompts, eos)
    assert ours.tokens == ref.tokens
    assert any(len(t) < 20 for t in ref.tokens)  # EOS ended some row: a batch row left the cache
    assert ours.n_forward == ref.n_forward
    for got, want in zip(chosen_logprobs(ours), chosen_logprobs(ref)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
