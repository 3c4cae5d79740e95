"""Rollouts for the RL stages: G samples per prompt from a decoder, parsed and rewarded.

Shared by `ar_rl` and `rl`; the decoder is a small adapter object (ARPolicy in reranker/stages/ar_rl.py,
DiffusionPolicy in reranker/stages/rl.py) with three methods:

    sample(model, prompt_ids, generator, greedy) -> list[Sample]   one per prompt row, no gradients
    logprobs(model, prompt_ids, samples) -> (b, L) log-probs of each sample's positions, with gradients
    (attribute) name

A Sample carries what the decoder recorded: the response tokens (what is parsed), the log-prob of
the action at each position when it was sampled (logp_old) and which positions are actions.
`collect` is DAPO's dynamic sampling on top (used by the training loop), `validate_policy` the
greedy evaluation.
Prompts are rendered exactly as SFT encodes them (reranker/training/batches.py), and an answer is
parsed exactly as the engine parses it (text up to the end-of-turn token, parse_ranking).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reranker.rl.policy_gradient import nonzero_variance
from reranker.rl.rewards import ALPHA, rank_reward
from reranker.text.answer import ParseResult, parse_ranking
from reranker.training import distributed as D
from reranker.training.batches import _ids, end_of_turn


@dataclass
class RLPrompt:
    ids: list[int]
    candidate_sids: list[str]  # retriever order
    target_index: int  # the target's position in that order
    # The candidate indices in the order the prompt lists them (a pre-ranker's, reranker/data/preranker.py);
    # None: the retriever order. The reward's incoming rank, the copy check and the fallback read it.
    incoming: list[int] | None = None

    @property
    def n(self) -> int:
        return len(self.candidate_sids)

    @property
    def listed(self) -> list[int]:
        """The candidate indices as the prompt lists them."""
        return list(range(self.n)) if self.incoming is None else list(self.incoming)


@dataclass
class Sample:
    tokens: list[int]  # response ids through EOS (what the answer parser sees)
    logprobs: torch.Tensor  # (L,) log p(action) at sampling time, aligned with the decoder's positions
    actions: torch.Tensor  # (L,) bool: positions whose token is an action of the policy gradient
    trajectory: object = None  # the diffusion Trajectory (rl), None for AR


@dataclass
class Rollout:
    prompt: int  # index of its prompt in the list given to generate_rollouts
    sample: Sample
    text: str
    parse: ParseResult
    reward: float

    @property
    def valid(self) -> bool:
        return self.parse.ok

    listed: list[int]  # its prompt's order (RLPrompt.listed)

    @property
    def copy(self) -> bool:
        """A valid answer that repeats the order its prompt listed (the degenerate policy GR2's reward fights)."""
        p = self.parse.permutation
        return p is not None and list(p) == self.listed


def load_prompts(tokenizer, records: list[dict], max_prompt_len: int, sids_path=None) -> tuple[list[RLPrompt], int]:
    """RLPrompts of the records that have a target in their list; returns (prompts, skipped).

    Candidate SIDs come from the record's `candidate_sids`, else from `candidates` through the SID
    map at `sids_path`. A prompt over `max_prompt_len` loses tokens from the left, as in SFT."""
    sids = None
    out, skipped = [], 0
    for k, rec in enumerate(records):
        t = rec.get("target_index")
        if not isinstance(t, int):
            skipped += 1
            continue
        cands = rec.get("candidate_sids")
        if cands is None:
            if sids is None:
                if sids_path is None or not Path(sids_path).is_file():
                    raise ValueError(f"record {k} has no candidate_sids and no SID map was found at {sids_path}")
                from reranker.text.sid import SemanticIds

                sids = SemanticIds.load(sids_path)
            cands = [sids.sid_string(c) for c in rec["candidates"]]
        if not 0 <= t < len(cands):
            raise ValueError(f"record {k}: target_index {t} outside its {len(cands)} candidates")
        order = rec.get("prompt_order")
        if order is not None and sorted(order) != list(range(len(cands))):
            raise ValueError(f"record {k}: field 'prompt_order' {order} is not a permutation of its "
                             f"{len(cands)} candidates")
        ids = _ids(tokenizer.apply_chat_template(rec["prompt_messages"], add_generation_prompt=True, tokenize=True))
        out.append(RLPrompt(ids[-max_prompt_len:], list(cands), t, None if order is None else [int(j) for j in order]))
    return out, skipped


class Scorer:
    """Text of a response and its reward (GR2: R_rank + α·R_fmt, conditional format reward, −1 invalid)."""

    def __init__(self, tokenizer, alpha: float = ALPHA):
        self.tokenizer = tokenizer
        self.end = end_of_turn(tokenizer)
        self.alpha = alpha

    @property
    def eos_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.end)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else pad

    def __call__(self, prompt: RLPrompt, tokens: list[int]) -> tuple[str, ParseResult, float]:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False).split(self.end, 1)[0]
        parsed = parse_ranking(text, prompt.candidate_sids)
        return text, parsed, rank_reward(parsed.permutation, prompt.target_index, prompt.n, self.alpha,
                                         prompt.listed.index(prompt.target_index))


@torch.no_grad()
def generate_rollouts(policy, model, prompts: list[RLPrompt], group_size: int, scorer: Scorer, generator,
                      batch_size: int = 64, greedy: bool = False) -> list[list[Rollout]]:
    """group_size samples for every prompt -> one list of Rollouts per prompt (its group).

    The prompts are repeated group_size times and decoded in chunks of `batch_size` rows (one
    batched decode per chunk, so finished rows leave the batch early)."""
    rows = [i for i in range(len(prompts)) for _ in range(group_size)]
    samples: list[Sample] = []
    was_training = model.training
    model.eval()
    for a in range(0, len(rows), max(1, batch_size)):
        chunk = rows[a:a + batch_size]
        samples += policy.sample(model, [prompts[i].ids for i in chunk], generator, greedy)
    model.train(was_training)
    groups: list[list[Rollout]] = [[] for _ in prompts]
    for i, s in zip(rows, samples):
        text, parsed, reward = scorer(prompts[i], s.tokens)
        groups[i].append(Rollout(i, s, text, parsed, reward, prompts[i].listed))
    return groups


def rollout_stats(rollouts: list[Rollout]) -> dict:
    """Sums (not means) so ranks can all-reduce them: reward, valid, copy, response tokens, count."""
    return {"reward_sum": sum(r.reward for r in rollouts), "valid": sum(r.valid for r in rollouts),
            "copy": sum(r.copy for r in rollouts), "tokens": sum(len(r.sample.tokens) for r in rollouts),
            "rollouts": len(rollouts)}


def pad_samples(samples: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_old, actions), each (b, L) with L the longest sample (padding is not an action)."""
    L = max(1, max(len(s.logprobs) for s in samples))
    old = torch.zeros(len(samples), L)
    act = torch.zeros(len(samples), L, dtype=torch.bool)
    for r, s in enumerate(samples):
        old[r, :len(s.logprobs)] = s.logprobs
        act[r, :len(s.actions)] = s.actions
    return old.to(device), act.to(device)


def take_prompts(state, n: int, k: int, seed: int) -> list[int]:
    """The next k indices of the prompt stream (shuffled per epoch from (seed, epoch), crossing epochs
    as needed); advances state.epoch / state.cursor, so a checkpointed state resumes the stream."""
    out = []
    while len(out) < k:
        order = D.epoch_order(n, seed, state.epoch)
        chunk = order[state.cursor:state.cursor + k - len(out)]
        out += chunk
        state.cursor += len(chunk)
        if state.cursor >= n:
            state.epoch, state.cursor = state.epoch + 1, 0
    return out


def round_seed(seed: int, iteration: int, rnd: int, rank: int) -> int:
    """Sampling seed of one draw round on one rank: a resumed run redraws what the lost one drew."""
    return (((seed * 1_000_003 + iteration) * 1_009 + rnd) * 101 + rank) % (2 ** 63)


@torch.no_grad()
def validate_policy(policy, model, prompts, scorer, batch_size, rank=0, world=1, device="cpu") -> dict:
    """Greedy decode of every prompt (sharded over ranks): R@1 with the engine's fallback (the order
    the prompt listed), valid rate, copy rate, mean reward and response length."""
    mine = D.shard(list(range(len(prompts))), rank, world)
    sums = [0.0] * 6  # hits, valid, copy, reward, tokens, n
    gen = torch.Generator(device=device).manual_seed(0)  # unused by greedy decoding
    for a in range(0, len(mine), batch_size):
        ps = [prompts[i] for i in mine[a:a + batch_size]]
        for p, (r,) in zip(ps, generate_rollouts(policy, model, ps, 1, scorer, gen, batch_size, greedy=True)):
            first = r.parse.permutation[0] if r.valid else p.listed[0]
            parts = [first == p.target_index, r.valid, r.copy, r.reward, len(r.sample.tokens), 1]
            sums = [x + float(y) for x, y in zip(sums, parts)]
    hits, valid, copy, reward, tokens, n = D.all_reduce_sum(sums, device)
    n = max(n, 1)
    return {"r1": hits / n, "valid_rate": valid / n, "copy_rate": copy / n, "reward_mean": reward / n,
            "mean_tokens": tokens / n, "n": n}


def collect(policy, model, prompts, state, cfg, scorer, seed, rank, world, device):
    """One iteration's training groups with DAPO dynamic sampling.

    Each round draws cfg["prompts_per_step"] prompts (global; rank r decodes every world-th one),
    samples cfg["group_size"] rollouts of each and drops the groups whose rewards are all equal;
    rounds repeat until that many groups are kept or cfg["max_draw_rounds"] is reached. The first
    prompts_per_step kept groups in draw order are used. Returns (this rank's used groups as
    (global slot, prompt, rollouts), the number used globally, global rollout statistics)."""
    P, G = int(cfg["prompts_per_step"]), int(cfg["group_size"])
    kept, keys = [], []
    sums = {"reward_sum": 0.0, "valid": 0.0, "copy": 0.0, "tokens": 0.0, "rollouts": 0.0}
    drawn = rounds = 0
    for rnd in range(int(cfg["max_draw_rounds"])):
        idx = take_prompts(state, len(prompts), P, seed)
        mine = list(range(rank, len(idx), world))
        gen = torch.Generator(device=device).manual_seed(round_seed(seed, state.iteration, rnd, rank))
        groups = generate_rollouts(policy, model, [prompts[idx[j]] for j in mine], G, scorer, gen,
                                   int(cfg["rollout_batch_size"]))
        for k, v in rollout_stats([r for g in groups for r in g]).items():
            sums[k] += v
        keep = nonzero_variance(torch.tensor([[r.reward for r in g] for g in groups])) if groups else []
        for j, g, ok in zip(mine, groups, keep):
            if ok:
                kept.append(((rnd, j), prompts[idx[j]], g))
        keys += [key for part in D.all_gather_object([k for k, _, _ in kept if k[0] == rnd]) for key in part]
        drawn, rounds = drawn + len(idx), rounds + 1
        if len(keys) >= P:
            break
    slot = {key: i for i, key in enumerate(sorted(keys)[:P])}  # the first P kept groups, in draw order
    mine_kept = [(slot[key], p, g) for key, p, g in kept if key in slot]
    tot = dict(zip(sums, D.all_reduce_sum(list(sums.values()), device)))
    n = max(tot["rollouts"], 1)
    stats = {"reward_mean": tot["reward_sum"] / n, "valid_rate": tot["valid"] / n, "copy_rate": tot["copy"] / n,
             "response_tokens_mean": tot["tokens"] / n, "kept_frac": len(keys) / max(drawn, 1),
             "groups_used": len(slot), "prompts_drawn": drawn, "draw_rounds": rounds}
    return mine_kept, len(slot), stats
