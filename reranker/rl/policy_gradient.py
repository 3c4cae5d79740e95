"""Policy-gradient math shared by `ar_rl` (DAPO) and `rl` (TraceRL-style GRPO on the diffusion model).

Pure tensor functions, no model code:

* group_advantages: A_i = (r_i - mean_g) / (std_g + eps) over the G rollouts of one prompt (GRPO).
  std is the population std (divide by G), so a normalized group has unit RMS.
* nonzero_variance: DAPO dynamic sampling keeps only groups whose rewards differ; a group where every
  rollout scored the same has all-zero advantages and would only dilute the token normalization.
* policy_loss: per action token, -min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A) with ρ = exp(logp_new -
  logp_old), plus optionally β·KL(π‖π_ref) by the k3 estimator. It returns the SUM over the batch's
  action tokens; the caller divides by the action tokens of the whole (global) batch, which is DAPO's
  token-level normalization (long answers are not down-weighted per token as with per-sequence means).
  ε_low = ε_high = 0.2 is GRPO's symmetric clip; DAPO decouples them (0.2 / 0.28, "clip-higher") so
  unlikely tokens with positive advantage can still grow, which fights entropy collapse.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards (n_groups, G) -> advantages of the same shape."""
    r = rewards.to(torch.float32)
    mean = r.mean(-1, keepdim=True)
    std = r.std(-1, unbiased=False, keepdim=True)
    return (r - mean) / (std + eps)


def nonzero_variance(rewards: torch.Tensor, tol: float = 1e-8) -> torch.Tensor:
    """(n_groups, G) -> bool (n_groups,): groups whose rewards are not all equal."""
    return (rewards.amax(-1) - rewards.amin(-1)) > tol


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_new ‖ π_ref) at tokens sampled from π: exp(d) - d - 1 with
    d = logp_ref - logp_new. Unbiased, always >= 0, low variance (Schulman's estimator, as in GRPO)."""
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1.0


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.28, logp_ref: torch.Tensor | None = None,
                kl_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate summed over action tokens.

    logp_new (b, L) with gradients; logp_old (b, L) from the rollout; advantages (b,) or (b, L);
    mask (b, L) bool, the action tokens. Returns (loss_sum, stats); stats are detached sums over
    action tokens (divide by stats["tokens"] or by the global count for means).
    """
    mask = mask.to(torch.bool)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    adv = advantages.to(logp_new.dtype).expand_as(logp_new)
    # Differences outside the mask can be garbage (padding): zero them before exp, not after.
    log_ratio = torch.where(mask, logp_new - logp_old.to(logp_new.dtype), torch.zeros_like(logp_new))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if logp_ref is not None and kl_coef:
        kl = kl_k3(logp_new, logp_ref.to(logp_new.dtype))
        per_token = per_token + kl_coef * kl
    loss_sum = (per_token * mask).sum()
    with torch.no_grad():
        m = mask.to(torch.float32)
        # A token is "clipped" when the clipped branch won the min, i.e. its gradient is zero.
        was_clipped = (clipped < unclipped) & mask
        stats = {
            "tokens": float(m.sum()),
            "ratio_sum": float((ratio * m).sum()),
            "ratio_dev_max": float(((ratio - 1).abs() * m).max()) if m.any() else 0.0,
            "clipped_tokens": float(was_clipped.sum()),
            # k1 estimate of KL(old ‖ new) at the sampled tokens: how far the update moved.
            "approx_kl_sum": float((-log_ratio * m).sum()),
            "kl_ref_sum": float((kl * m).sum()) if kl is not None else 0.0,
        }
    return loss_sum, stats
