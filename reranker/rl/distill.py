"""Divergences between a frozen teacher and a student, per position, for on-policy distillation.

p = teacher, q = student, both over the next token at one position:

    forward KL   KL(p || q) = sum_i p_i (log p_i - log q_i)      mass-covering (the OPD default)
    reverse KL   KL(q || p) = sum_i q_i (log q_i - log p_i)      mode-seeking
    JSD(beta)    beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
                 (generalized JSD of GKD, Agarwal et al. 2024; symmetric at beta = 0.5)

The teacher's distribution is cached once per rollout (`cache_teacher`): either in full (k = 0) or
as its top-k logits plus the log-sum-exp of ALL its logits (k = 64 by default). With top-k both
distributions are coarse-grained onto the same k + 1 outcomes: the teacher's k best tokens and one
"tail" bucket holding everything else (teacher tail mass = 1 - sum of its top-k probabilities,
student tail mass = logsumexp of the student logits off the teacher's top-k). Any divergence of the
coarse distributions is a proper divergence (0 iff they agree on the buckets), never exceeds the
full one (data processing inequality), and is exact when k covers the vocabulary. For forward KL
the gap is exactly p_tail * KL(p(.|tail) || q(.|tail)) (chain rule), i.e. it vanishes as the
teacher's tail mass does; with a peaked teacher and k = 64 it is negligible.

The teacher side is always detached: gradients flow to the student only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
# Teacher log-probs are floored here (mass e^-60 ~ 1e-26) so that a token the teacher gives zero
# probability (e.g. a student-only token, or an empty tail bucket) keeps reverse KL finite.
LOG_FLOOR = -60.0


@dataclass
class TeacherLogits:
    """The cached teacher distribution at N positions.

    Full (indices is None): values = all V logits. Top-k: values = the k largest logits and
    indices their token ids. lse = logsumexp over ALL teacher logits, so top-k log-probs are exact.
    """
    values: torch.Tensor             # (N, V) or (N, k) float32
    lse: torch.Tensor                # (N,)
    indices: torch.Tensor | None = None  # (N, k) long, or None for full logits

    @property
    def top_k(self) -> int:
        return 0 if self.indices is None else self.indices.shape[-1]

    def __len__(self) -> int:
        return self.values.shape[0]

    def to(self, device) -> "TeacherLogits":
        idx = None if self.indices is None else self.indices.to(device)
        return TeacherLogits(self.values.to(device), self.lse.to(device), idx)

    def rows(self, start: int, stop: int) -> "TeacherLogits":
        """The cache at positions start..stop-1 (positions are rows of these tensors)."""
        idx = None if self.indices is None else self.indices[start:stop]
        return TeacherLogits(self.values[start:stop], self.lse[start:stop], idx)

    @staticmethod
    def cat(parts: list["TeacherLogits"]) -> "TeacherLogits":
        idx = None if parts[0].indices is None else torch.cat([p.indices for p in parts])
        return TeacherLogits(torch.cat([p.values for p in parts]), torch.cat([p.lse for p in parts]), idx)


@torch.no_grad()
def cache_teacher(logits: torch.Tensor, k: int = 64) -> TeacherLogits:
    """Teacher logits (N, V) -> cache; k = 0 or k >= V keeps the full logits."""
    logits = logits.detach().float()
    lse = torch.logsumexp(logits, -1)
    if k <= 0 or k >= logits.shape[-1]:
        return TeacherLogits(logits, lse)
    values, indices = logits.topk(k, -1)
    return TeacherLogits(values, lse, indices)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable on both ends (Maechler 2012)."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def coarse_logprobs(student_logits: torch.Tensor, teacher: TeacherLogits) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q) on shared outcomes: the full vocabulary, or the teacher's top-k plus a tail bucket.

    student_logits: (N, Vs) with Vs >= the teacher's vocabulary; extra student tokens (e.g. a mask
    token added at conversion) get teacher probability 0 (full mode) or fall in the tail (top-k).
    """
    log_q_all = torch.log_softmax(student_logits.float(), -1)
    if teacher.indices is None:
        log_p = teacher.values - teacher.lse[:, None]
        extra = log_q_all.shape[-1] - log_p.shape[-1]
        if extra < 0:
            raise ValueError(f"student vocabulary ({log_q_all.shape[-1]}) is smaller than the teacher's "
                             f"({log_p.shape[-1]})")
        log_p = torch.nn.functional.pad(log_p, (0, extra), value=-math.inf)
        return log_p.clamp(min=LOG_FLOOR), log_q_all
    log_p_top = teacher.values - teacher.lse[:, None]                       # (N, k)
    log_p_tail = _log1mexp(torch.logsumexp(log_p_top, -1))                  # log(1 - sum p_top)
    log_q_top = log_q_all.gather(-1, teacher.indices)
    off_top = log_q_all.scatter(-1, teacher.indices, -math.inf)
    log_q_tail = torch.logsumexp(off_top, -1)                               # exact, no cancellation
    log_p = torch.cat([log_p_top, log_p_tail[:, None]], -1).clamp(min=LOG_FLOOR)
    log_q = torch.cat([log_q_top, log_q_tail[:, None]], -1)
    return log_p, log_q


def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim from log-probs; outcomes with a = 0 contribute 0 (0 log 0 = 0)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def forward_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return kl(log_p, log_q)


def reverse_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    return kl(log_q, log_p)


def generalized_jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    if not 0.0 < beta < 1.0:
        raise ValueError(f"JSD beta must be in (0, 1), got {beta}")
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), 0)
    return beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)


def divergence(student_logits: torch.Tensor, teacher: TeacherLogits, kind: str = "forward_kl",
               beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence (N,) between the cached teacher and the student logits (N, Vs)."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")
    teacher = teacher.to(student_logits.device)
    log_p, log_q = coarse_logprobs(student_logits, teacher)
    if kind == "forward_kl":
        return forward_kl(log_p, log_q)
    if kind == "reverse_kl":
        return reverse_kl(log_p, log_q)
    return generalized_jsd(log_p, log_q, beta)
