"""Divergence math for OPD: zeros where they must be, the direct formula, the top-k cache's error,
JSD symmetry, and gradients to the student only."""
import math

import pytest
import torch

from reranker.rl.distill import cache_teacher, coarse_logprobs, divergence, generalized_jsd

torch.set_num_threads(1)
V, N = 50, 12
KINDS = ["forward_kl", "reverse_kl", "jsd"]


def logits(seed, scale=3.0, n=N, v=V):
    return scale * torch.randn(n, v, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [0, 8, V])
def test_divergence_of_a_distribution_with_itself_is_zero(kind, k):
    t = logits(0)
    d = divergence(t + 1.7, cache_teacher(t, k), kind)  # a shift of the logits is the same distribution
    assert d.shape == (N,)
    torch.testing.assert_close(d, torch.zeros(N), atol=1e-6, rtol=0)


def test_forward_kl_equals_the_direct_formula():
    t, s = logits(1), logits(2)
    p, log_p, log_q = t.softmax(-1), t.log_softmax(-1), s.log_softmax(-1)
    direct = (p * (log_p - log_q)).sum(-1)
    for k in (0, V, V + 5):  # k = 0 or k >= V: the full distribution
        torch.testing.assert_close(divergence(s, cache_teacher(t, k), "forward_kl"), direct, atol=1e-5, rtol=1e-5)
    reverse = (log_q.exp() * (log_q - log_p)).sum(-1)
    torch.testing.assert_close(divergence(s, cache_teacher(t, 0), "reverse_kl"), reverse, atol=1e-5, rtol=1e-5)
    assert (direct > 0).all()


def test_top_k_error_is_the_tail_term_and_exact_when_k_covers_the_vocabulary():
    t, s = logits(3), logits(4)
    full = divergence(s, cache_teacher(t, 0), "forward_kl")
    prev = None
    for k in (1, 4, 16, 32, V - 1):
        cache = cache_teacher(t, k)
        assert cache.top_k == k and cache.values.shape == (N, k)
        approx = divergence(s, cache, "forward_kl")
        # Chain rule: full KL = coarse KL + p_tail * KL(p(.|tail) || q(.|tail)), so the error is
        # that term exactly, never negative, and bounded by p_tail * max log-ratio on the tail.
        off = torch.ones(N, V, dtype=torch.bool).scatter(-1, cache.indices, False)
        lp, lq = t.log_softmax(-1), s.log_softmax(-1)
        lp_tail = torch.logsumexp(lp.masked_fill(~off, -math.inf), -1)
        lq_tail = torch.logsumexp(lq.masked_fill(~off, -math.inf), -1)
        cond_p, cond_q = (lp - lp_tail[:, None]), (lq - lq_tail[:, None])
        tail_kl = torch.where(off, cond_p.exp() * (cond_p - cond_q), torch.zeros(())).sum(-1)
        err = full - approx
        torch.testing.assert_close(err, lp_tail.exp() * tail_kl, atol=1e-5, rtol=1e-4)
        assert (err >= -1e-6).all()
        bound = lp_tail.exp() * torch.where(off, cond_p - cond_q, torch.full((), -math.inf)).amax(-1).clamp(min=0)
        assert (err <= bound + 1e-5).all()
        if prev is not None:  # more of the teacher kept, smaller error
            assert (err <= prev + 1e-5).all()
        prev = err
    # k = V - 1 leaves a one-token tail: the coarse distribution IS the full one.
    torch.testing.assert_close(prev, torch.zeros(N), atol=1e-5, rtol=0)
    # reverse KL and JSD on the coarse outcomes never exceed the full ones (data processing)
    for kind in ("reverse_kl", "jsd"):
        assert (divergence(s, cache_teacher(t, 8), kind) <= divergence(s, cache_teacher(t, 0), kind) + 1e-5).all()


def test_top_k_of_a_peaked_teacher_is_nearly_exact():
    t, s = logits(5, scale=8.0, v=400), logits(6, v=400)
    full = divergence(s, cache_teacher(t, 0))
    assert ((full - divergence(s, cache_teacher(t, 64))).abs() / full).max() < 1e-3


def test_jsd_is_symmetric_at_half_and_bounded():
    a, b = logits(7), logits(8)
    ab = divergence(b, cache_teacher(a, 0), "jsd", beta=0.5)
    ba = divergence(a, cache_teacher(b, 0), "jsd", beta=0.5)
    torch.testing.assert_close(ab, ba, atol=1e-6, rtol=1e-5)
    assert (ab > 0).all() and (ab <= math.log(2) + 1e-6).all()
    lp, lq = coarse_logprobs(b, cache_teacher(a, 0))
    assert not torch.allclose(generalized_jsd(lp, lq, 0.1), generalized_jsd(lq, lp, 0.1))  # beta != 0.5: not
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(lp, lq, 1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [0, 8])
def test_gradients_reach_the_student_only(kind, k):
    t = logits(9).requires_grad_()
    s = logits(10).requires_grad_()
    divergence(s, cache_teacher(t, k), kind).sum().backward()
    assert t.grad is None
    assert s.grad is not None and torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    # at the optimum (student = teacher) the gradient vanishes
    s2 = t.detach().clone().requires_grad_()
    divergence(s2, cache_teacher(t, k), kind).sum().backward()
    assert s2.grad.abs().max() < 1e-5


def test_student_only_tokens_get_no_teacher_mass():
    """A student with one more token (a mask token added at conversion): finite, and the gradient
    pushes the student's mass off that token."""
    t = logits(11)
    s = torch.cat([t, torch.zeros(N, 1)], -1).requires_grad_()
    for k in (0, 8):
        for kind in KINDS:
            d = divergence(s, cache_teacher(t, k), kind)
            assert torch.isfinite(d).all() and (d > 0).all()
        s.grad = None
        divergence(s, cache_teacher(t, k), "forward_kl").sum().backward()
        assert (s.grad[:, -1] > 0).all()  # descending lowers the extra logit


def test_unknown_divergence_is_an_error():
    with pytest.raises(ValueError, match="forward_kl"):
        divergence(logits(0), cache_teacher(logits(1), 0), "tv")
