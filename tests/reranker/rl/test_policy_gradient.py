"""The shared RL math: group advantages, the zero-variance filter, DAPO's clipped token-level
objective (checked against a hand computation) and its gradient at ratio 1 (plain policy gradient)."""
import math

import pytest
import torch

from reranker.rl.policy_gradient import group_advantages, kl_k3, nonzero_variance, policy_loss

torch.set_num_threads(1)


def test_advantages_are_normalized_per_group():
    r = torch.tensor([[0.7, 0.0, 0.0, -1.0], [0.2, 0.2, 0.2, 0.2], [1.0, 3.0, 5.0, 7.0]])
    a = group_advantages(r)
    assert torch.allclose(a[0].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(a[0].pow(2).mean(), torch.tensor(1.0), atol=1e-4)  # population std: unit RMS
    assert torch.equal(a[1], torch.zeros(4))  # a constant group carries no signal
    # scale and shift invariant: only the order within the group matters
    torch.testing.assert_close(a[2], group_advantages(r[2:] * 10 - 4)[0], atol=1e-5, rtol=0)
    assert a[0].argmax() == 0 and a[0].argmin() == 3


def test_zero_variance_groups_are_dropped():
    r = torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.7, 0.0], [0.2, 0.2, 0.2], [0.0, 0.0, 1e-3]])
    assert nonzero_variance(r).tolist() == [False, True, False, True]


def _hand_loss(new, old, adv, mask, el, eh):
    total = 0.0
    for i in range(len(new)):
        for t in range(len(new[i])):
            if not mask[i][t]:
                continue
            rho = math.exp(new[i][t] - old[i][t])
            total += -min(rho * adv[i], min(max(rho, 1 - el), 1 + eh) * adv[i])
    return total


def test_clipped_objective_matches_hand_computation():
    # Ratios 1.5 and 0.5 fall outside [0.8, 1.28]; 1.1 is inside; the last token is padding.
    new = [[math.log(1.5), math.log(1.1), 0.3], [math.log(0.5), math.log(1.5), -9.0]]
    old = [[0.0, 0.0, 0.3], [0.0, 0.0, 5.0]]
    adv = [1.0, -2.0]
    mask = [[True, True, True], [True, True, False]]
    loss, st = policy_loss(torch.tensor(new), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), 0.2, 0.28)
    # by hand: A>0: -min(1.5, 1.28) = -1.28, -1.1, -1.0; A<0: -min(-1.0, -1.6) = 1.6, -min(-3, -2.56) = 3
    assert loss.item() == pytest.approx(-1.28 - 1.1 - 1.0 + 1.6 + 3.0, abs=1e-5)
    assert loss.item() == pytest.approx(_hand_loss(new, old, adv, mask, 0.2, 0.28), abs=1e-5)
    # zero-gradient (clipped) tokens: ratio 1.5 with A > 0 and ratio 0.5 with A < 0
    assert st["tokens"] == 5 and st["clipped_tokens"] == 2
    # symmetric GRPO clip changes only the clipped branch
    loss2, _ = policy_loss(torch.tensor(new), torch.tensor(old), torch.tensor(adv), torch.tensor(mask), 0.2, 0.2)
    assert loss2.item() == pytest.approx(_hand_loss(new, old, adv, mask, 0.2, 0.2), abs=1e-5)


def test_ratio_one_gradient_is_the_plain_policy_gradient():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(3, 5, 7, generator=g, requires_grad=True)  # a tabular policy: (rollout, position, vocab)
    tokens = torch.randint(0, 7, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.3, -0.4, -0.9])

    def logp():
        return torch.log_softmax(theta, -1).gather(-1, tokens[..., None]).squeeze(-1)

    lp = logp()
    loss, st = policy_loss(lp, lp.detach(), adv, mask, 0.2, 0.28)
    (ppo,) = torch.autograd.grad(loss, theta)
    reinforce = -(adv[:, None] * logp() * mask).sum()  # -Σ A · log π(a)
    (pg,) = torch.autograd.grad(reinforce, theta)
    torch.testing.assert_close(ppo, pg)
    assert st["ratio_dev_max"] == 0 and st["clipped_tokens"] == 0


def test_reference_kl_term():
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    kl = kl_k3(new, ref)
    assert kl[0, 0] == 0 and kl[0, 1] > 0 and (kl >= 0).all()
    mask = torch.ones(1, 2, dtype=torch.bool)
    base, _ = policy_loss(new, new.detach(), torch.zeros(1), mask)
    with_kl, st = policy_loss(new, new.detach(), torch.zeros(1), mask, logp_ref=ref, kl_coef=0.5)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * kl.sum().item(), abs=1e-6)
    assert st["kl_ref_sum"] == pytest.approx(kl.sum().item(), abs=1e-6)
