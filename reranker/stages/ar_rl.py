"""`ar_rl`: DAPO on the AR GR2 re-ranker: the RL loop (training/policy_optimization.py) with the
AR decoder as the policy.

Rollouts come from ar_decode; every generated token (EOS included) is an action. logp_old is what
the decoder recorded while sampling; logp_new is one teacher-forced forward in the decoder's own
layout, so the first ratios are 1 up to float round-off.
"""
from __future__ import annotations

import torch

from reranker.diffusion.ar_decoder import ar_decode
from reranker.diffusion.forward import forward
from reranker.diffusion.masks import block_causal_mask, pack_prompt_response, position_ids_for
from reranker.rl.rollouts import Sample, Scorer
from reranker.stages.base import Stage, StageContext, StageResult
from reranker.training import policy_optimization as PO

DEFAULTS = {
    **PO.DEFAULTS,
    "top_p": 1.0,  # < 1 truncates sampling but not the recorded log-probs: a biased gradient
}
check_config = PO.check_config  # the loop checks every key ar_rl has (top_p needs none)


# ---------------------------------------------------------------------------- the AR policy

def teacher_forced_logprobs(model, prompts, responses, pad_id, temperature=1.0):
    """log p(response token t | prompt, response[:t]) under softmax(logits / T), (b, Lmax), with
    gradients. Same layout as ar_decode (left-padded prompts, explicit positions, additive
    block-causal mask with one-token blocks), so it recomputes what the decoder recorded."""
    dev = model.device
    ids, plen, rlen = pack_prompt_response(prompts, responses, pad_id)
    ids, plen, rlen = ids.to(dev), plen.to(dev), rlen.to(dev)
    L = int(rlen.max())
    T = ids.shape[1]
    P = T - L
    col = torch.arange(T, device=dev)
    valid = (col[None] >= (P - plen)[:, None]) & (col[None] < (P + rlen)[:, None])
    grp = torch.zeros(T, dtype=torch.long, device=dev)
    mask = block_causal_mask(col, grp, col, grp, valid)
    # AR shift: the logit at column P-1+t predicts response token t; keep only those L columns.
    logits = forward(model, ids, position_ids_for(plen, P, T), mask, logits_to_keep=L + 1)[:, :-1]
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


class ARPolicy:
    """Rollouts from ar_decode; every generated token (EOS included) is an action."""
    name = "ar"

    def __init__(self, eos_id, pad_id, max_new_tokens, temperature=1.0, top_p=1.0):
        self.eos_id, self.pad_id = eos_id, pad_id
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def sample(self, model, prompt_ids, generator, greedy=False):
        res = ar_decode(model, prompt_ids, self.max_new_tokens, self.eos_id, self.pad_id,
                        temperature=0.0 if greedy else self.temperature, top_p=1.0 if greedy else self.top_p,
                        generator=generator)
        return [Sample(list(t), lp.float().cpu(), torch.ones(len(t), dtype=torch.bool))
                for t, lp in zip(res.tokens, res.logprobs)]

    def logprobs(self, model, prompt_ids, samples):
        return teacher_forced_logprobs(model, prompt_ids, [s.tokens for s in samples], self.pad_id, self.temperature)


def make_ar_policy(model, scorer: Scorer, cfg: dict) -> ARPolicy:
    return ARPolicy(scorer.eos_id, scorer.pad_id, int(cfg["max_new_tokens"]), float(cfg["temperature"]),
                    float(cfg["top_p"]))


class ARRLStage(Stage):
    name, defaults = "ar_rl", DEFAULTS

    def run(self, ctx: StageContext) -> StageResult:
        metrics, steps = PO.train_policy(ctx, make_ar_policy)
        return StageResult(metrics=metrics, optimizer_steps=steps)
