from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decoder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODER_UNSPECIFIED: _ClassVar[Decoder]
    DECODER_AR: _ClassVar[Decoder]
    DECODER_DIFFUSION: _ClassVar[Decoder]
    DECODER_AR_LOOKUP: _ClassVar[Decoder]

class CommitRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMIT_RULE_UNSPECIFIED: _ClassVar[CommitRule]
    COMMIT_RULE_CONFIDENCE: _ClassVar[CommitRule]
    COMMIT_RULE_PREFIX: _ClassVar[CommitRule]

class ComputeDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPUTE_DTYPE_UNSPECIFIED: _ClassVar[ComputeDtype]
    COMPUTE_DTYPE_FLOAT32: _ClassVar[ComputeDtype]
    COMPUTE_DTYPE_BFLOAT16: _ClassVar[ComputeDtype]
DECODER_UNSPECIFIED: Decoder
DECODER_AR: Decoder
DECODER_DIFFUSION: Decoder
DECODER_AR_LOOKUP: Decoder
COMMIT_RULE_UNSPECIFIED: CommitRule
COMMIT_RULE_CONFIDENCE: CommitRule
COMMIT_RULE_PREFIX: CommitRule
COMPUTE_DTYPE_UNSPECIFIED: ComputeDtype
COMPUTE_DTYPE_FLOAT32: ComputeDtype
COMPUTE_DTYPE_BFLOAT16: ComputeDtype

class DecodeOptions(_message.Message):
    __slots__ = ("decoder", "tau", "block_size", "return_reasoning", "top_k", "max_new_tokens", "commit_rule", "hold_eos", "window", "reuse_settled", "lookup_drafts", "compute_dtype")
    DECODER_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RETURN_REASONING_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_RULE_FIELD_NUMBER: _ClassVar[int]
    HOLD_EOS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    REUSE_SETTLED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    decoder: Decoder
    tau: float
    block_size: int
    return_reasoning: bool
    top_k: int
    max_new_tokens: int
    commit_rule: CommitRule
    hold_eos: bool
    window: int
    reuse_settled: bool
    lookup_drafts: bool
    compute_dtype: ComputeDtype
    def __init__(self, decoder: _Optional[_Union[Decoder, str]] = ..., tau: _Optional[float] = ..., block_size: _Optional[int] = ..., return_reasoning: _Optional[bool] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., commit_rule: _Optional[_Union[CommitRule, str]] = ..., hold_eos: _Optional[bool] = ..., window: _Optional[int] = ..., reuse_settled: _Optional[bool] = ..., lookup_drafts: _Optional[bool] = ..., compute_dtype: _Optional[_Union[ComputeDtype, str]] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("item_id", "score")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    score: float
    def __init__(self, item_id: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class RerankRequest(_message.Message):
    __slots__ = ("user_id", "history", "candidates", "options")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    history: _containers.RepeatedScalarFieldContainer[str]
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    options: DecodeOptions
    def __init__(self, user_id: _Optional[str] = ..., history: _Optional[_Iterable[str]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., options: _Optional[_Union[DecodeOptions, _Mapping]] = ...) -> None: ...

class RankedItem(_message.Message):
    __slots__ = ("item_id", "score", "previous_rank", "new_rank")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_RANK_FIELD_NUMBER: _ClassVar[int]
    NEW_RANK_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    score: float
    previous_rank: int
    new_rank: int
    def __init__(self, item_id: _Optional[str] = ..., score: _Optional[float] = ..., previous_rank: _Optional[int] = ..., new_rank: _Optional[int] = ...) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("decoder", "generated_tokens", "forward_passes", "batch_size", "queue_ms", "decode_ms")
    DECODER_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    decoder: str
    generated_tokens: int
    forward_passes: int
    batch_size: int
    queue_ms: float
    decode_ms: float
    def __init__(self, decoder: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., forward_passes: _Optional[int] = ..., batch_size: _Optional[int] = ..., queue_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ...) -> None: ...

class RerankResponse(_message.Message):
    __slots__ = ("items", "valid", "fallback", "failure", "reasoning", "stats", "history_truncated", "history_used", "history_unknown")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_USED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RankedItem]
    valid: bool
    fallback: bool
    failure: str
    reasoning: str
    stats: DecodeStats
    history_truncated: bool
    history_used: int
    history_unknown: int
    def __init__(self, items: _Optional[_Iterable[_Union[RankedItem, _Mapping]]] = ..., valid: _Optional[bool] = ..., fallback: _Optional[bool] = ..., failure: _Optional[str] = ..., reasoning: _Optional[str] = ..., stats: _Optional[_Union[DecodeStats, _Mapping]] = ..., history_truncated: _Optional[bool] = ..., history_used: _Optional[int] = ..., history_unknown: _Optional[int] = ...) -> None: ...

class RecommendRequest(_message.Message):
    __slots__ = ("user_id", "history", "num_candidates", "options")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    history: _containers.RepeatedScalarFieldContainer[str]
    num_candidates: int
    options: DecodeOptions
    def __init__(self, user_id: _Optional[str] = ..., history: _Optional[_Iterable[str]] = ..., num_candidates: _Optional[int] = ..., options: _Optional[_Union[DecodeOptions, _Mapping]] = ...) -> None: ...

class RecommendResponse(_message.Message):
    __slots__ = ("result", "retrieval_ms")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_MS_FIELD_NUMBER: _ClassVar[int]
    result: RerankResponse
    retrieval_ms: float
    def __init__(self, result: _Optional[_Union[RerankResponse, _Mapping]] = ..., retrieval_ms: _Optional[float] = ...) -> None: ...
