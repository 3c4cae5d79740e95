"""Decoders: AR (the teacher) and block diffusion (the student), sharing one forward helper, plus
trajectory replay for OPD / RL.

Imports are lazy so `import reranker.decoding.rules` (the commit-rule names a parser offers) stays
cheap; `from reranker.decoding import diffusion_decode` works as before. `reranker.decoding.forward`
is the forward-helper module (its function is `reranker.decoding.forward.forward`).
"""
__all__ = ["ARResult", "ar_decode", "DiffusionResult", "Trajectory", "diffusion_decode",
           "commit_confident", "pick_tokens", "replay_logits", "replay_logprobs"]


def __getattr__(name):
    if name in ("ARResult", "ar_decode"):
        from .ar import ARResult, ar_decode
    elif name in ("DiffusionResult", "Trajectory", "diffusion_decode"):
        from .diffusion import DiffusionResult, Trajectory, diffusion_decode
    elif name in ("commit_confident", "pick_tokens"):
        from .forward import commit_confident, pick_tokens
    elif name in ("replay_logits", "replay_logprobs"):
        from .replay import replay_logits, replay_logprobs
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return locals()[name]
