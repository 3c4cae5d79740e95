"""The one forward helper both decoders (and replay) use, plus token choice and the commit rule.

Keeping a single code path for "run these columns against this cache under this mask" is what
makes B = 1 block diffusion reproduce AR decoding token for token, and replay reproduce decoding
(log-probs within float32 round-off). (A batch with a one-token prompt prefills with a mask for
diffusion and row by row for AR, prompt_prefill.py: the same values up to round-off.)
"""
import contextlib
import functools
import inspect
import time

import torch

from reranker.decoding import (DEFAULT_COMMIT_RULE, DEFAULT_COMPUTE_DTYPE,  # the decode settings' one owner
                               check_commit_rule, check_compute_dtype)
from .kv_cache import in_place_cache


def clock(device) -> float:
    """Wall seconds, after the device's queued work is done (CUDA runs asynchronously), so the
    decoders can report how much of a call was the prompt prefill."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@functools.cache
def _cache_kwarg(model_class):
    """transformers 5.x renamed `past_key_values` to `cache` (the old name warns, then goes away).
    Looked up once per model class: a signature costs about a tenth of a small model's step."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def compute_precision(device, compute_dtype=DEFAULT_COMPUTE_DTYPE):
    """The context a decode runs its forwards in: nothing for float32; for bfloat16, torch.autocast,
    so matmuls take bfloat16 inputs while weights, norms, the residual stream and the logits stay
    float32 (a model cast to bfloat16 whole lost more answers on Beauty's selection lists). Entered
    once per decode call, not per forward: autocast keeps the bfloat16 copy of a weight that
    requires grad (a loaded model's do) for as long as the context lasts, so each weight is cast once
    a call. Autocast is per thread: enter it on the thread that decodes."""
    check_compute_dtype(compute_dtype)
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def new_cache(model):
    """An empty KV cache that appends in place (kv_cache.py). Our masks encode full (not
    sliding-window) attention, so refuse configs with other layer types rather than decode them
    subtly wrong."""
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        raise NotImplementedError(f"only full-attention layers are supported, got {sorted(set(types))}")
    return in_place_cache(text.num_hidden_layers)


def crop(cache, n):
    """Drop the last n cached columns (transformers 5.x crop takes a negative count)."""
    if n > 0:
        cache.crop(-n)


def select_rows(cache, idx):
    """Keep only batch rows idx of the cache (finished rows stop costing compute)."""
    cache.batch_select_indices(idx)


def forward(model, input_ids, position_ids, mask, cache=None, logits_to_keep=0, packed_rows=None):
    """Logits (float32) for input_ids; grows `cache` in place by input_ids.shape[1] columns.

    mask: additive float (b, 1, q, cached + q) or boolean 'allowed' of that shape; it is cast to
    the model dtype here (sdpa wants the mask in the query dtype). None: causal attention over the
    input alone, no padding, an empty cache (prompt_prefill.py; the kernel runs it as is_causal).
    packed_rows: a packed_rows.PackedRows plan (input_ids (1, N) hold several rows' columns, which
    its attention writes into plan.cache itself; `cache` is then None and the mask is the plan's
    (b + writers, 1, block, kv_len)), or a PromptRow (one row's prompt, mask None). Only inside
    packed_rows_attention(model).
    """
    dtype = model.dtype
    if mask is not None and mask.dtype != dtype:  # (None: causal, no padding; prompt_prefill.py)
        allowed = mask if mask.dtype == torch.bool else mask >= 0
        mask = torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
    kwargs = {_cache_kwarg(type(model)): cache} if cache is not None else {}
    if packed_rows is not None:
        kwargs["packed_rows"] = packed_rows
    out = model(input_ids=input_ids, position_ids=position_ids,
                attention_mask=None if mask is None else mask.to(input_ids.device),
                use_cache=cache is not None, logits_to_keep=logits_to_keep, **kwargs)
    return out.logits.float()


def pick_tokens(logits, temperature=0.0, top_p=1.0, generator=None):
    """Choose a token per position. Returns (tokens, logprobs, probs) where logprobs/probs are
    those of the chosen token under softmax(logits / T) (T = 1 for greedy, before any top-p
    truncation), i.e. the quantity replay recomputes for RL importance ratios."""
    T = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / T, -1)
    if temperature <= 0:
        tokens = logp.argmax(-1)
    else:
        p = logp.exp()
        if top_p < 1.0:
            sp, si = p.sort(-1, descending=True)
            drop = sp.cumsum(-1) - sp > top_p  # keep the smallest prefix with mass >= top_p
            p = torch.zeros_like(p).scatter(-1, si, sp.masked_fill(drop, 0.0))
        flat = p.reshape(-1, p.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])
    lp = logp.gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, lp, lp.exp()


def commit_confident(confidence, eligible, tau, force_all=False, rule=DEFAULT_COMMIT_RULE, hold=None,
                     drafted=None, confirmed=None):
    """Which positions to commit this step.

    rule "confidence" (the paper's): every eligible (still masked) position whose confidence is
    >= tau, plus the single most confident eligible position per row (progress guarantee).
    rule "prefix": left to right. The leftmost eligible position is always committed, then each
    following position while it is confident (>= tau) or already committed; the run stops at the
    first unsure masked position. A token is then never committed while an earlier token of its
    block is still unknown, which is what a trace whose later tokens depend on earlier ones (a
    running best over counts) needs. With B = 1 it is AR decoding; with tau > 1, one token per step
    in AR order (the model still sees the masked rest of its block).

    confidence: (b, B) float (probability of the chosen token); eligible: (b, B) bool.
    force_all commits every eligible position (used at the last allowed step of a block).
    hold: optional (b, B) bool, positions whose chosen token may not ride on confidence alone: they
    are committed only as the one position a step must commit (the leftmost under "prefix", the
    most confident under "confidence"). The decoder holds EOS this way on request: under "prefix" an
    answer then never ends in the same step as the tokens before its end.
    drafted / confirmed: optional (b, B) bool, "prefix" only (lookup drafts, diffusion_decode): a
    drafted position's input token was a draft, not the mask; it is sure exactly when `confirmed`
    (the token chosen just before it equals that draft, so it read the block as committed through
    its left neighbour, as the leftmost masked position of the next step would), whatever its
    confidence, and never on confidence alone after a draft that was not confirmed.
    """
    check_commit_rule(rule)
    if force_all:
        return eligible.clone()
    sure = eligible & (confidence >= tau)
    if drafted is not None:  # the decoder allows drafts under "prefix" only (diffusion_decode checks it)
        sure = torch.where(drafted, eligible & confirmed, sure)
    if hold is not None:
        sure = sure & ~hold
    if rule == "prefix":
        leftmost = eligible & (eligible.int().cumsum(-1) == 1)
        passable = ~eligible | sure | leftmost  # committed before, or committed now
        return eligible & passable.int().cumprod(-1).bool()
    conf = confidence.masked_fill(~eligible, -1.0)
    best = conf.argmax(-1, keepdim=True)
    forced = torch.zeros_like(eligible).scatter(-1, best, True) & eligible
    return sure | forced
