"""Request validation and response building for the re-ranking service.

Every rejection is a ValidationError whose text starts with the offending field
("candidates[3].score: not finite (nan)"), which the server returns as INVALID_ARGUMENT. Checks
run cheapest first and stop at the first problem, so a huge malformed request costs little.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from proto.diffusion_gr2.v1 import reranker_pb2 as pb

from ..decoding import DecodeOptions, DecodeSettingError
from ..engine import RerankRequest, RerankResult
from .client import ENUM_SETTINGS as CLIENT_ENUMS
from .options import ServiceLimits

# proto enum -> decode setting name: the client's table read backwards (0, UNSPECIFIED, is unset)
ENUM_SETTINGS = {name: {enum: setting for setting, enum in table.items() if setting is not None}
                 for name, table in CLIENT_ENUMS.items()}


class ValidationError(ValueError):
    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass
class Prepared:
    """A validated request, ready for the batcher."""
    request: RerankRequest
    options: DecodeOptions
    scores: list[float]
    top_k: int  # 0: all
    return_reasoning: bool
    history_truncated: bool
    history_unknown: int

    prompt_ids: list[int] | None = None  # rendered at the handler (the context check), decoded as is

    @property
    def batch_key(self) -> tuple:
        # requests share a batched decode only when every decode setting matches
        return self.options.key


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _check_id(field: str, item: str, limits: ServiceLimits) -> None:
    if not item:
        raise ValidationError(field, "empty item id")
    if len(item) > limits.max_item_id_chars:
        raise ValidationError(field, f"item id of {len(item)} characters; at most {limits.max_item_id_chars}")


def _wire_float(value: float) -> float:
    """The decimal a client wrote into a proto `float` (32 bits): 0.3 arrives as 0.30000001192...,
    and decoding with that would compare confidences against another tau than `dgr2 eval --tau 0.3`
    does. The shortest decimal that rounds to the same float32 is what was meant."""
    return float(str(np.float32(value)))


def validate_options(opts: pb.DecodeOptions, limits: ServiceLimits, diffusion_available: bool,
                     n_candidates: int, defaults: DecodeOptions | None = None) -> tuple[DecodeOptions, int, bool]:
    """(engine DecodeOptions, top_k, return_reasoning) from the proto options: each field set overrides
    `defaults` (the server's: its flags over the model's recorded settings), then the one validation
    of reranker.decoding, with "options." before the field it names."""
    values = {}
    for name, names in ENUM_SETTINGS.items():
        value = getattr(opts, name)
        if value == 0:  # UNSPECIFIED: not given
            continue
        if value not in names:  # proto3 enums are open: any int can arrive
            enum = opts.DESCRIPTOR.fields_by_name[name].enum_type
            known = [enum.values_by_number[n].name for n in names]
            raise ValidationError(f"options.{name}", f"unknown value {value}; use {', '.join(known[:-1])} or "
                                                     f"{known[-1]}")
        values[name] = names[value]
    for name, cast in (("tau", _wire_float), ("block_size", int), ("max_new_tokens", int), ("hold_eos", bool),
                       ("window", int), ("reuse_settled", bool), ("lookup_drafts", bool)):
        if opts.HasField(name):
            values[name] = cast(getattr(opts, name))
    max_new = values.get("max_new_tokens")
    if max_new is not None and not 1 <= max_new <= limits.max_new_tokens:
        raise ValidationError("options.max_new_tokens", f"must be in [1, {limits.max_new_tokens}], got {max_new}")
    defaults = defaults or DecodeOptions(max_new_tokens=limits.max_new_tokens)
    try:
        options = replace(defaults, **values).validate("options.")
    except DecodeSettingError as e:
        raise ValidationError(e.field, e.problem) from None
    if options.decoder == "diffusion" and not diffusion_available:
        raise ValidationError("options.decoder", "diffusion needs a converted model; this server's model is AR only")
    # top_k larger than the list just means "all of them"
    top_k = min(int(opts.top_k), n_candidates)
    return options, top_k, bool(opts.return_reasoning)


def truncate_history(history, limits: ServiceLimits) -> tuple[list[str], bool]:
    """The most recent max_history items (history is oldest first), and whether any were dropped."""
    items = list(history[-limits.max_history:])
    for k, item in enumerate(items):
        _check_id(f"history[{len(history) - len(items) + k}]", item, limits)
    return items, len(history) > len(items)


def validate_rerank(req: pb.RerankRequest, known: Callable[[str], bool], limits: ServiceLimits,
                    diffusion_available: bool, defaults: DecodeOptions | None = None, needs_scores: bool = False,
                    history_len: int | None = None) -> Prepared:
    """The checked request. needs_scores: the model's pre-ranker reads the candidates' scores, so a
    request whose scores are all 0 (proto3's unset value) is refused; history_len: the history's
    length before a caller cut it (Recommend), else the request's own."""
    size = req.ByteSize()
    if size > limits.max_message_bytes:
        raise ValidationError("request", f"{size} bytes; at most {limits.max_message_bytes}")
    if len(req.user_id) > limits.max_item_id_chars:
        raise ValidationError("user_id", f"{len(req.user_id)} characters; at most {limits.max_item_id_chars}")
    n = len(req.candidates)
    if n == 0:
        raise ValidationError("candidates", "empty; send at least one candidate")
    if limits.max_candidates is not None and n > limits.max_candidates:  # None: the server derives it at start
        raise ValidationError("candidates", f"{n} candidates; at most {limits.max_candidates}")
    seen: dict[str, int] = {}
    ids, scores = [], []
    for i, cand in enumerate(req.candidates):
        field = f"candidates[{i}]"
        _check_id(f"{field}.item_id", cand.item_id, limits)
        if cand.item_id in seen:
            raise ValidationError(f"{field}.item_id", f"duplicate of candidates[{seen[cand.item_id]}] "
                                                      f"({_short(cand.item_id)})")
        if not known(cand.item_id):
            raise ValidationError(f"{field}.item_id",
                                  f"unknown item {_short(cand.item_id)} (not in the model's catalog)")
        if not math.isfinite(cand.score):
            raise ValidationError(f"{field}.score", f"not finite ({cand.score})")
        seen[cand.item_id] = i
        ids.append(cand.item_id)
        scores.append(float(cand.score))
    if needs_scores and not any(scores):
        raise ValidationError("candidates", "every score is 0 (unset?); this model's pre-ranker orders the "
                                            "candidates by features of their retriever scores: send them")
    history, truncated = truncate_history(req.history, limits)
    options, top_k, reasoning = validate_options(req.options, limits, diffusion_available, n, defaults)
    unknown = sum(1 for h in history if not known(h))  # the engine leaves these out of the prompt
    whole = len(req.history) if history_len is None else int(history_len)
    return Prepared(RerankRequest(history=history, candidates=ids, scores=scores, user=req.user_id or None,
                                  history_len=whole),
                    options, scores, top_k, reasoning, truncated, unknown)


def is_permutation(perm, n: int) -> bool:
    return len(perm) == n and sorted(int(p) for p in perm) == list(range(n))


def build_response(prep: Prepared, result: RerankResult, queue_ms: float, decode_ms: float,
                   batch_size: int) -> pb.RerankResponse:
    n = len(prep.request.candidates)
    perm, valid, fallback, failure = list(result.permutation), result.valid, result.fallback, result.failure or ""
    if not is_permutation(perm, n):  # the engine guarantees this; the wire contract must not depend on it
        perm, valid, fallback, failure = list(range(n)), False, True, failure or "invalid_permutation"
    shown = perm[:prep.top_k] if prep.top_k else perm
    items = [pb.RankedItem(item_id=prep.request.candidates[j], score=prep.scores[j], previous_rank=j + 1,
                           new_rank=r + 1) for r, j in enumerate(shown)]
    stats = pb.DecodeStats(decoder=prep.options.decoder, generated_tokens=int(result.generated_tokens),
                           forward_passes=int(result.forward_passes), batch_size=batch_size,
                           queue_ms=queue_ms, decode_ms=decode_ms)
    return pb.RerankResponse(items=items, valid=valid, fallback=fallback, failure=failure,
                             reasoning=result.reasoning if prep.return_reasoning else "", stats=stats,
                             history_truncated=prep.history_truncated, history_used=len(prep.request.history),
                             history_unknown=prep.history_unknown)
