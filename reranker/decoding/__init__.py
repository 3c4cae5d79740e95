"""Decoders: AR (the teacher) and block diffusion (the student), sharing one forward helper, plus
trajectory replay for OPD / RL."""
from .ar import ARResult, ar_decode
from .diffusion import DiffusionResult, Trajectory, diffusion_decode
from .forward import commit_confident, forward, pick_tokens
from .replay import replay_logits, replay_logprobs

__all__ = ["ARResult", "ar_decode", "DiffusionResult", "Trajectory", "diffusion_decode",
           "commit_confident", "forward", "pick_tokens", "replay_logits", "replay_logprobs"]
