"""GR2's re-ranking reward, shared by AR RL (`ar_rl`) and diffusion RL (`rl`).

R = R_rank + alpha * R_fmt, with R_rank = (rank_pre(target) - rank_re(target)) / N. The format
reward is paid only when the target strictly moves up, or was first and stays first: paying it for
any valid answer lets the policy collect it by copying the incoming order (the order the prompt
listed: the retriever's, or a pre-ranker's). An answer that does not
parse to a valid permutation gets R = -1.
"""
from __future__ import annotations

from collections.abc import Sequence

ALPHA = 0.2
INVALID = -1.0


def rank_reward(permutation: Sequence[int] | None, target_index: int, n: int, alpha: float = ALPHA,
                incoming_rank: int | None = None) -> float:
    """Reward of one answer. `permutation` lists candidate indices best first (None: invalid);
    `target_index` is the target's candidate index; `incoming_rank` its position in the order the
    prompt listed (None: target_index, the retriever's order; a pre-ranker's order otherwise)."""
    if permutation is None:
        return INVALID
    if not 0 <= target_index < n:
        raise ValueError(f"target_index {target_index} outside the {n} candidates")
    pre = target_index if incoming_rank is None else int(incoming_rank)
    if not 0 <= pre < n:
        raise ValueError(f"incoming_rank {pre} outside the {n} candidates")
    new = list(permutation).index(target_index)
    r_rank = (pre - new) / n
    paid = new < pre or (pre == 0 and new == 0)
    return r_rank + (alpha if paid else 0.0)
