"""`rl`: TraceRL-style GRPO/DAPO on the block-diffusion re-ranker (after OPD; any converted model works).

The loop is the one ar_rl runs (training/policy_optimization.py); only the policy differs:

* Rollouts come from diffusion_decode with the τ, block size and sampling temperature the model is
  served with (defaults: τ = 0.9, the block size recorded in config.diffusion, T = 1), and each
  rollout's denoising trajectory is recorded: which token was committed at which step of its block,
  and its log-prob at that moment (logp_old).
* logp_new is replay_logprobs on that trajectory: every committed token re-scored on exactly the
  canvas it was committed from, in one forward per micro-batch, with gradients. Not a one-step
  mean-field estimate (all tokens of a block scored from a fully masked canvas), which is a
  different policy from the one that sampled and would give ratios != 1 before any update.
* Clip ε = 0.2 on both sides (GRPO), optional k3 KL to a reference replayed on the same trajectory
  (default off).

Which committed tokens are actions (`action_tokens`):
* "kept" (default): committed positions up to and including the first EOS. A block can hold tokens
  committed after EOS's position (in the same or an earlier step than EOS); the decoder discards
  them from the output, so the reward never sees them. Pushing them with the answer's advantage is
  noise, and it would also train the tail of the last block away from what CFT taught it (EOS fill),
  which is what lets the decoder finish that block in one confident step. The cost: such a token
  may have been on the canvas when a kept token was committed, so dropping its score term is a
  (small) bias in the policy gradient.
* "committed": every committed position (the exact trajectory likelihood, higher variance).
Positions never committed are never actions.
"""
from __future__ import annotations

from reranker.decoding import served_rollout_settings
from reranker.diffusion.convert import load_diffusion_config
from reranker.diffusion.diffusion_decoder import diffusion_decode
from reranker.diffusion.forward import check_commit_rule
from reranker.diffusion.replay import replay_logprobs
from reranker.rl.rollouts import Sample, Scorer
from reranker.stages.base import Stage, StageContext, StageResult
from reranker.training import policy_optimization as PO

ACTION_TOKENS = ("kept", "committed")

DEFAULTS = {
    **PO.DEFAULTS,  # no top_p: the diffusion decoder has none
    "eps_low": 0.2,
    "eps_high": 0.2,  # GRPO's symmetric clip
    "tau": None,  # commit threshold; None: the student's recorded one (reranker.decoding), as served
    "block_size": None,  # None: config.diffusion.block_size of the input model
    "max_steps_per_block": None,  # None: block_size (the decoder's default)
    "commit_rule": None,  # the decoder's commit rule; None: the student's recorded one, as served
    "action_tokens": "kept",
    "replay_max_windows": None,  # bound the noisy windows per replay forward (memory); same result
}


def check_config(cfg: dict) -> None:
    PO.check_config(cfg)
    if cfg["action_tokens"] not in ACTION_TOKENS:
        raise ValueError(f"action_tokens must be one of {ACTION_TOKENS}, got {cfg['action_tokens']!r}")
    if cfg["tau"] is not None and not 0.0 < float(cfg["tau"]) <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {cfg['tau']}")
    if cfg["commit_rule"] is not None:
        check_commit_rule(cfg["commit_rule"], "commit_rule")


class DiffusionPolicy:
    """Rollouts from diffusion_decode with recorded trajectories; log-probs by trajectory replay."""
    name = "diffusion"

    def __init__(self, block_size, mask_id, eos_id, pad_id, max_new_tokens, tau=0.9, temperature=1.0,
                 max_steps_per_block=None, action_tokens="kept", max_windows=None, commit_rule="confidence"):
        self.block_size, self.mask_id, self.eos_id, self.pad_id = block_size, mask_id, eos_id, pad_id
        self.commit_rule = commit_rule
        self.max_new_tokens, self.tau, self.temperature = max_new_tokens, tau, temperature
        self.max_steps_per_block, self.action_tokens, self.max_windows = max_steps_per_block, action_tokens, max_windows

    def sample(self, model, prompt_ids, generator, greedy=False):
        res = diffusion_decode(model, prompt_ids, self.max_new_tokens, self.block_size, self.mask_id, self.eos_id,
                               self.pad_id, tau=self.tau, temperature=0.0 if greedy else self.temperature,
                               max_steps_per_block=self.max_steps_per_block, generator=generator,
                               commit_rule=self.commit_rule)
        out = []
        for toks, tr in zip(res.tokens, res.trajectories):
            actions = tr.committed & tr.kept if self.action_tokens == "kept" else tr.committed.clone()
            out.append(Sample(list(toks), tr.logprobs.float(), actions, tr))
        return out

    def logprobs(self, model, prompt_ids, samples):
        return replay_logprobs(model, prompt_ids, [s.trajectory for s in samples], self.block_size,
                               self.temperature, self.mask_id, self.pad_id, self.max_windows)


def make_diffusion_policy(model, scorer: Scorer, cfg: dict) -> DiffusionPolicy:
    info = load_diffusion_config(model)
    cfg = {**cfg, **served_rollout_settings(cfg, model.config)}
    if info is None:
        raise ValueError("rl needs a block-diffusion model (config.diffusion); convert the AR model first "
                         "(reranker.diffusion.convert.convert_to_diffusion / dgr2 convert)")
    return DiffusionPolicy(int(cfg["block_size"] or info["block_size"]), int(info["mask_token_id"]), scorer.eos_id,
                           scorer.pad_id, int(cfg["max_new_tokens"]), float(cfg["tau"]), float(cfg["temperature"]),
                           cfg["max_steps_per_block"], cfg["action_tokens"], cfg["replay_max_windows"],
                           cfg["commit_rule"])


class DiffusionRLStage(Stage):
    name, defaults = "rl", DEFAULTS

    def run(self, ctx: StageContext) -> StageResult:
        metrics, steps = PO.train_policy(ctx, make_diffusion_policy, check_config)
        return StageResult(metrics=metrics, optimizer_steps=steps)
