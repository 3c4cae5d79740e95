"""Vectorised [x_0 ; x_t] diffusion loss == slow per-block reference; no look-ahead across blocks."""
import pytest
import torch
import torch.nn.functional as F

from reranker.diffusion.forward import forward
from reranker.diffusion.loss import diffusion_loss, sample_noise, suffix_aligned
from reranker.diffusion.masks import diffusion_training_mask, pack_prompt_response
from reranker.model import SIZES, build_model

torch.set_num_threads(1)
V, MASK = 40, 39


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 39, (n,), generator=g).tolist() for n in (6, 3, 1)]
    resps = [torch.randint(3, 39, (n,), generator=g).tolist() + [1] for n in (9, 4, 6)]
    return prompts, resps


def reference_loss(model, prompts, resps, B, t, target_mask, weights):
    """One row and one block at a time: [prefix + clean windows < k ; noisy window k], mask built
    position by position (prefix causal, clean windows block-causal, noisy window sees all clean
    columns and itself), no padding anywhere."""
    total, n_tok = 0.0, 0
    C = t.shape[0]
    for r, (z, y) in enumerate(zip(prompts, resps)):
        P, L = len(z), len(y)
        x = torch.tensor(z + y)
        n_tok += L
        for k in range(-(-L // B)):
            n_clean = P - 1 + k * B
            w = min(B, L - k * B)                          # window width (last block may be partial)
            for c in range(C):
                m = target_mask[c, r, k * B:k * B + w]
                win = x[P - 1 + k * B:P - 1 + k * B + w].clone()
                win[1:][m[:-1]] = MASK                     # hide the input copy of masked targets
                ids = torch.cat([x[:n_clean], win])[None]
                T = n_clean + w
                allowed = torch.zeros(T, T, dtype=torch.bool)
                for i in range(T):
                    for j in range(T):
                        if i >= n_clean:
                            allowed[i, j] = True
                        elif j < n_clean:
                            wi = None if i < P - 1 else (i - P + 1) // B
                            wj = None if j < P - 1 else (j - P + 1) // B
                            allowed[i, j] = j <= i if wi is None else (wj is None or wj <= wi)
                mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
                pos = torch.cat([torch.arange(n_clean), torch.arange(n_clean, T)])[None]
                logits = forward(model, ids, pos, mask)[0, n_clean:]
                ce = F.cross_entropy(logits, x[P + k * B:P + k * B + w], reduction="none")
                total = total + (ce * m * weights[r, k * B:k * B + w] / t[c, r]).sum()
    return total / (C * n_tok)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("B,complementary", [(4, False), (3, True), (1, False)])
def test_vectorised_equals_reference(attn, B, complementary):
    model = build_model(V, SIZES["tiny"], attn_implementation=attn)
    prompts, resps = make_batch()
    ids, plen, rlen = pack_prompt_response(prompts, resps, pad_id=0)
    g = torch.Generator().manual_seed(1)
    n_cols = -(-int(rlen.max()) // B) * B
    t, m = sample_noise(rlen, n_cols, complementary=complementary, generator=g)
    weights = torch.rand(3, int(rlen.max()), generator=g) + 0.5
    fast = diffusion_loss(model, ids, plen, rlen, B, MASK, weights, t=t, target_mask=m)
    with torch.no_grad():
        slow = reference_loss(model, prompts, resps, B, t, m, weights)
    assert fast.requires_grad and torch.isfinite(fast)
    torch.testing.assert_close(fast.detach(), slow, atol=1e-5, rtol=1e-5)
    fast.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_noise_and_defaults():
    model = build_model(V, SIZES["tiny"])
    prompts, resps = make_batch()
    ids, plen, rlen = pack_prompt_response(prompts, resps, pad_id=0)
    t, m = sample_noise(rlen, 12, complementary=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m[0], ~m[1]) and torch.allclose(t[0] + t[1], torch.ones(3))
    none = diffusion_loss(model, ids, plen, rlen, 4, MASK, t=t[:1], target_mask=torch.zeros_like(m[:1]))
    assert none.item() == 0.0
    drawn = diffusion_loss(model, ids, plen, rlen, 4, MASK, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(drawn) and drawn.item() > 0


def test_suffix_aligned_keeps_counts_and_moves_masks_to_block_ends():
    m = torch.tensor([[1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = suffix_aligned(m, 4)
    assert out.int().tolist() == [[0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="whole blocks"):
        suffix_aligned(m[:, :10], 4)


def test_suffix_prob_aligns_that_share_of_examples_and_keeps_t():
    rlen = torch.full((400,), 16)
    t0, m0 = sample_noise(rlen, 16, generator=torch.Generator().manual_seed(3))
    t1, m1 = sample_noise(rlen, 16, generator=torch.Generator().manual_seed(3), block_size=4, suffix_prob=0.5)
    assert torch.equal(t0, t1)  # same t, same per-block counts: the 1/t weight is unchanged
    blocks = lambda m: m.view(1, 400, 4, 4)
    assert torch.equal(blocks(m0).sum(-1), blocks(m1).sum(-1))
    is_suffix = (blocks(m1) == suffix_aligned(m1, 4).view(1, 400, 4, 4)).all(-1).all(-1)[0]
    moved = ~(m0 == m1).all(-1)[0]
    assert 150 < int(moved.sum()) < 250 and bool(is_suffix[moved].all())
    _, m_all = sample_noise(rlen, 16, generator=torch.Generator().manual_seed(3), block_size=4, suffix_prob=1.0)
    assert torch.equal(m_all, suffix_aligned(m0, 4))
    with pytest.raises(ValueError, match="block_size"):
        sample_noise(rlen, 16, suffix_prob=0.5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_position_depends_on_a_later_block(attn):
    """Perturb the clean inputs of windows > k and every noisy window != k: the logits of clean
    windows <= k and of noisy window k must not move (and the prefix never sees the response)."""
    model = build_model(V, SIZES["tiny"], attn_implementation=attn).eval()
    B, P, n = 4, 5, 4
    plen, rlen = torch.tensor([P]), torch.tensor([n * B])
    mask, pos = diffusion_training_mask(plen, rlen, B, 1)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 39, (1, P - 1 + n * B), generator=g)
    noisy = clean[:, P - 1:].clone()
    noisy[torch.rand(noisy.shape, generator=g) < 0.5] = MASK
    noisy[:, ::B] = clean[:, P - 1::B]
    base = forward(model, torch.cat([clean, noisy], 1), pos, mask)
    nc = P - 1 + n * B
    for k in range(n):
        c2, n2 = clean.clone(), noisy.clone()
        c2[:, P - 1 + (k + 1) * B:] = torch.randint(3, 39, c2[:, P - 1 + (k + 1) * B:].shape, generator=g)
        other = torch.ones(n * B, dtype=torch.bool)
        other[k * B:(k + 1) * B] = False
        n2[:, other] = torch.randint(3, 39, (int(other.sum()),), generator=g)
        out = forward(model, torch.cat([c2, n2], 1), pos, mask)
        keep_clean = P - 1 + (k + 1) * B
        torch.testing.assert_close(out[:, :keep_clean], base[:, :keep_clean], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, nc + k * B:nc + (k + 1) * B], base[:, nc + k * B:nc + (k + 1) * B],
                                   atol=1e-5, rtol=0)
    # and via autograd: d(noisy window 1 logits) / d(input embeddings) is zero outside its context
    emb = model.get_input_embeddings()(torch.cat([clean, noisy], 1)).detach().requires_grad_(True)
    out = model(inputs_embeds=emb, position_ids=pos, attention_mask=mask).logits
    out[:, nc + B:nc + 2 * B].sum().backward()
    touched = emb.grad.abs().sum(-1)[0] > 0
    expect = torch.zeros_like(touched)
    expect[:P - 1 + B] = True                  # prefix + clean window 0
    expect[nc + B:nc + 2 * B] = True           # itself
    assert torch.equal(touched, expect)
