"""The diffusion heart: one sequence layout and mask rule (masks), the masked-diffusion loss of CFT
(loss), AR -> block-diffusion conversion (convert), and the decoders that share the rule: AR, the
B = 1 case and the teacher (ar_decoder), greedy AR with exact prompt-lookup drafts
(lookup_decoder), block diffusion, the student (diffusion_decoder; rows in lockstep), and its
greedy batches with rows moving through their blocks independently (independent_decoder, whose
steps are packed: packed_rows). All run over one forward helper (forward), one prompt prefill
(prompt_prefill) and a KV cache that appends in place (kv_cache), with trajectory replay for OPD / RL
(replay). The decode settings, commit rules included, are reranker.decoding's.

Imports are lazy; `from reranker.diffusion import
diffusion_decode` imports its module on first use. `reranker.diffusion.forward` is the forward-helper
module (its function is `reranker.diffusion.forward.forward`).
"""
__all__ = ["ARResult", "ar_decode", "LookupResult", "ar_lookup_decode", "DiffusionResult", "Trajectory",
           "diffusion_decode", "commit_confident", "pick_tokens", "replay_logits", "replay_logprobs"]


def __getattr__(name):
    if name in ("ARResult", "ar_decode"):
        from .ar_decoder import ARResult, ar_decode
    elif name in ("LookupResult", "ar_lookup_decode"):
        from .lookup_decoder import LookupResult, ar_lookup_decode
    elif name in ("DiffusionResult", "Trajectory", "diffusion_decode"):
        from .diffusion_decoder import DiffusionResult, Trajectory, diffusion_decode
    elif name in ("commit_confident", "pick_tokens"):
        from .forward import commit_confident, pick_tokens
    elif name in ("replay_logits", "replay_logprobs"):
        from .replay import replay_logits, replay_logprobs
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return locals()[name]
