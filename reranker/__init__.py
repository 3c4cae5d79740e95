"""The generative reasoning re-ranker, one subpackage per step of the flow.

text (semantic IDs, tokenizer, prompts, the parsed answer) -> data (re-ranking examples and their
reasoning traces) -> training (what every stage shares, the initial model) -> diffusion (masks,
loss, AR -> diffusion conversion, decoders) -> stages (sft, ar_rl, cft, opd, rl as plugins, with
rl holding rewards, rollouts and the policy-gradient and distillation math) -> eval and service,
both over engine.py (request -> prompt -> decode -> valid permutation); model.py builds, loads and
saves the language models.
"""
