"""The re-ranking engine: request -> prompt -> (AR | AR + lookup | block-diffusion) decode -> validated permutation.

One object shared by evaluation (`dgr2 eval`), the gRPC service and the RecBole model class, so all
three render the same prompt, decode with the same code and apply the same fallback: an answer that
does not parse to a valid permutation returns the order the prompt listed the candidates in (the
retriever's, or the pre-ranker's where the data was built with one) with `fallback=True`.

It needs a model directory (HF causal LM + tokenizer; a converted model carries its diffusion
fields in config.json, and a model may record the decode settings it was trained for, which a
caller that sends none gets: reranker.decoding) and a re-ranking data directory (`dgr2 data
build`): the item <-> SID map, and, through build_info.json, the retrieval artifacts and item file
from which the collaborative evidence (co-purchase counts on the training split) is rebuilt; or a
release bundle (`dgr2 release`), whose build_info.json names its own saved evidence files instead.
Data built with `candidate_order: scorer` also carries its pre-ranker (reranker/data/preranker.py),
which orders every request's candidates before the prompt lists them, from the same features.
"""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reranker.data.evidence import CoPurchaseCounts, candidates_evidence
from reranker.decoding import DECODERS, DecodeOptions, recorded_settings, resolve  # noqa: F401 -- re-exported
from reranker.decoding import check_workers
from reranker.diffusion.ar_decoder import ar_decode
from reranker.diffusion.convert import load_diffusion_config
from reranker.diffusion.diffusion_decoder import diffusion_decode
from reranker.diffusion.forward import compute_precision
from reranker.diffusion.independent_decoder import diffusion_decode_independent
from reranker.diffusion.lookup_decoder import ar_lookup_decode
from reranker.diffusion.packed_rows import takes_packed_rows
from reranker.text.answer import parse_ranking, permutation_or_fallback
from reranker.text.prompt import DEFAULT_MAX_PROMPT_TOKENS, render_prompt_messages, render_prompt_within_budget
from reranker.text.sid import SemanticIds
from reranker.text.tokenizer import IM_END, load_tokenizer, THINK_CLOSE, THINK_OPEN


@dataclass
class RerankRequest:
    history: list[str]  # time ordered, oldest first
    candidates: list[str]  # retriever order
    scores: list[float] | None = None  # the retriever's; a pre-ranker needs them
    user: str | None = None  # only used to leave the user's own pairs out of the co-purchase counts
    history_len: int | None = None  # the user's whole history length, where `history` is cut (a feature)


@dataclass
class RerankResult:
    permutation: list[int]  # candidate indices, best first (always a valid permutation)
    valid: bool  # the model's own answer parsed to a valid permutation
    fallback: bool  # the order the prompt listed was returned instead (list_order; None: the retriever's)
    failure: str | None  # unparsable | out_of_set | duplicate | dropped
    reasoning: str
    text: str
    generated_tokens: int
    forward_passes: int  # forward passes of the batched decode this request was part of
    decode_seconds: float
    extra: dict = field(default_factory=dict)
    list_order: list[int] | None = None  # the order the prompt listed the candidates in (None: as given)


def split_reasoning(text: str) -> str:
    m = re.search(re.escape(THINK_OPEN) + r"(.*?)" + re.escape(THINK_CLOSE), text, flags=re.S)
    return m.group(1).strip() if m else ""


def rerank_batches(engine, batches, options=None, workers: int = 1):
    """engine.rerank(batch, options) for each batch of requests, yielded in order. With workers > 1,
    that many batches decode at once, each on torch's intra-op threads // workers (on a 2-core CPU,
    two workers of one thread decode about 1.9x the lists of one worker of two: docs/EXPERIMENTS.md,
    "Two decode workers of one thread against one worker of two"). The same batches and the same
    results either way; torch's thread count is restored when the batches are done. A bad worker
    count is an error at the call, before any batch decodes."""
    return _rerank_batches(engine, batches, options, check_workers(workers))


def _rerank_batches(engine, batches, options, workers):
    if workers == 1:
        for batch in batches:
            yield engine.rerank(batch, options)
        return
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="rerank-decode")
    try:
        torch.set_num_threads(max(1, threads // workers))
        yield from pool.map(lambda batch: engine.rerank(batch, options), batches)
    finally:
        pool.shutdown(cancel_futures=True)
        torch.set_num_threads(threads)


class RerankEngine:
    def __init__(self, model, tokenizer, sids: SemanticIds, item_meta, copurchase: CoPurchaseCounts | None,
                 profile: str = "cpu", max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
                 evidence_history: int | None = None, preranker=None, features=None, cross_fitted: bool = False):
        self.model = model.eval()
        # The pre-ranker and the training-split statistics its features read (FeatureContext); without
        # one the prompt lists the candidates as the request gives them. cross_fitted: order each user's
        # list by the model fitted without the user's half (the valid split's lists, `dgr2 eval`); no
        # effect without a pre-ranker.
        if (preranker is None) != (features is None):
            raise ValueError("a pre-ranker needs its feature context, and one without the other is unused")
        self.preranker, self.features, self.cross_fitted = preranker, features, bool(cross_fitted)
        if self.cross_fitted and preranker is not None and None in preranker.folds:
            raise ValueError("cross_fitted needs a pre-ranker with a model per user half (a run's data "
                             "directory; a release bundle carries the full model alone)")
        self.candidate_order = "scorer" if preranker is not None else "retriever"
        self.tokenizer = tokenizer
        self.sids = sids
        self.item_meta = item_meta
        self.copurchase = copurchase
        self.profile = profile
        self.max_prompt_tokens = max_prompt_tokens
        # Training prompts computed brand/category evidence over at most this many recent items.
        self.evidence_history = evidence_history
        self.diffusion = load_diffusion_config(model)
        # what the model directory records (reranker.decoding): the settings a caller that sends none gets
        self.recorded = recorded_settings(model.config)
        # the model's context: a prompt plus its generation budget must fit in it
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.eos_id = tokenizer.convert_tokens_to_ids(IM_END)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    @staticmethod
    def data_dir_for(model_dir, data_dir=None) -> Path:
        """`data_dir`, or, when none is given, the release bundle `model_dir` lies in (`dgr2 release`
        puts the models beside the data they serve: BUNDLE/student with --data BUNDLE)."""
        if data_dir is not None:
            return Path(data_dir)
        bundle = Path(model_dir).resolve().parent
        if not (bundle / "release.json").is_file():
            raise ValueError(f"--data: needed, {model_dir} is not inside a release bundle (no release.json in "
                             f"{bundle})")
        return bundle

    @classmethod
    def load(cls, model_dir, data_dir=None, device: str = "cpu", profile: str | None = None,
             cross_fitted: bool = False) -> "RerankEngine":
        """data_dir None: the release bundle model_dir lies in (data_dir_for). cross_fitted: see __init__."""
        from .model import load_model

        data_dir = cls.data_dir_for(model_dir, data_dir)
        info_path = data_dir / "build_info.json"
        if not info_path.exists():
            raise FileNotFoundError(f"{info_path}: missing; build the re-ranking data with `dgr2 data build`")
        info = json.loads(info_path.read_text())
        copurchase, meta = cls.load_evidence(data_dir, info)
        preranker, features = cls.load_preranker(data_dir, info, meta, copurchase)
        model = load_model(model_dir, device=device)  # first: it names a missing or damaged model dir
        tok = load_tokenizer(model_dir)
        return cls(model, tok, SemanticIds.load(data_dir / "sids.json"), meta, copurchase,
                   profile or info.get("profile", "cpu"),
                   int(info.get("max_prompt_tokens") or DEFAULT_MAX_PROMPT_TOKENS),
                   info.get("evidence_history_items") or None, preranker, features, cross_fitted)

    @staticmethod
    def load_preranker(data_dir, info: dict, meta, copurchase: CoPurchaseCounts | None = None):
        """(pre-ranker, its FeatureContext) of data built with candidate_order: scorer, else (None, None).
        ``copurchase``: the counts load_evidence read (the features count with the same ones)."""
        from reranker.data.features import FeatureContext
        from reranker.data.preranker import PreRanker, preranker_dir

        where = preranker_dir(data_dir, info)
        if where is None:
            return None, None
        window = int((info.get("copurchase") or {}).get("window", 1))
        return PreRanker.load(where), FeatureContext(RerankEngine.train_sequences_of(data_dir, info), meta,
                                                     window=window, copurchase=copurchase)

    @staticmethod
    def train_sequences_of(data_dir, info: dict) -> dict[str, list[str]]:
        """The training sequences a data directory's evidence counts over: a release bundle's saved
        ones, else its retrieval run's (each user's last two items removed)."""
        from candidate_gen.split import train_sequences

        data_dir = Path(data_dir)
        files = info.get("evidence_files")
        if files:  # a release bundle: the training sequences it saved
            if not files.get("train_sequences"):
                raise ValueError(f"{data_dir / 'build_info.json'}: evidence_files lacks 'train_sequences', "
                                 "which the pre-ranker's features need")
            return read_train_sequences(data_dir / files["train_sequences"])
        path = (data_dir / info["retrieval_dir"]).resolve() / "sequences.json"
        return train_sequences(json.loads(path.read_text(encoding="utf-8")))

    @staticmethod
    def load_evidence(data_dir, info: dict):
        """(co-purchase counts, item catalog) of a data directory, from its build_info.json `info`.
        Paths in build_info.json are relative to the data directory."""
        from candidate_gen.atomic import load_items

        from reranker.data.evidence import item_meta_lookup, load_item_catalog

        data_dir = Path(data_dir)
        files = info.get("evidence_files")
        if files:
            # a release bundle (integration/release.py): the evidence it saved, no retrieval artifacts
            missing = [k for k in ("copurchase", "item_fields") if not files.get(k)]
            if missing:
                raise ValueError(f"{data_dir / 'build_info.json'}: evidence_files lacks {missing}")
            return (CoPurchaseCounts.load(data_dir / files["copurchase"]),
                    load_item_catalog(data_dir / files["item_fields"]))
        sequences = (data_dir / info["retrieval_dir"]).resolve() / "sequences.json"
        items_path = (data_dir / info["items_path"]).resolve()
        # A data directory built by `dgr2 data build` reads its evidence from the retrieval run beside it;
        # copied or moved alone, it has none (a release bundle carries its own: evidence_files above).
        for key, path in (("retrieval_dir", sequences), ("items_path", items_path)):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{data_dir / 'build_info.json'}: {key} {info[key]!r} names {path}, which is missing; a data "
                    f"directory reads its evidence from the retrieval run it was built from, so move them "
                    f"together (or serve a release bundle, `dgr2 release`, which carries its own)")
        copurchase = CoPurchaseCounts.fit(RerankEngine.train_sequences_of(data_dir, info),
                                          window=int((info.get("copurchase") or {}).get("window", 1)))
        return copurchase, item_meta_lookup(load_items(items_path).to_frame())

    def decode_options(self, explicit=None) -> DecodeOptions:
        """Explicit settings over the model's recorded ones over the defaults (reranker.decoding.resolve)."""
        return resolve(explicit, self.recorded)

    def prompt_limit(self, max_new_tokens: int) -> int:
        """The most prompt tokens a request may take: the data's prompt budget, and what the model's
        context leaves beside `max_new_tokens` generated tokens."""
        if self.max_positions is None:
            return self.max_prompt_tokens
        return min(self.max_prompt_tokens, int(self.max_positions) - int(max_new_tokens))

    def known(self, item: str) -> bool:
        return item in self.sids

    def list_order(self, req: RerankRequest) -> list[int]:
        """The candidate indices in the order the prompt lists them: the pre-ranker's, else as given."""
        if self.preranker is None:
            return list(range(len(req.candidates)))
        return preranker_order(self.preranker, self.features, req, self.cross_fitted)

    def _prompt_inputs(self, req: RerankRequest):
        unknown = [c for c in req.candidates if not self.known(c)]
        if unknown:
            raise ValueError(f"candidate item {unknown[0]!r} has no semantic ID in this model's catalog")
        history = [h for h in req.history if self.known(h)]
        if self.evidence_history:
            history = history[-self.evidence_history:]
        candidates = [req.candidates[j] for j in self.list_order(req)]
        evidence = None
        if self.copurchase is not None:
            evidence = candidates_evidence(history, candidates, self.item_meta, self.copurchase, req.user)
        return (history, candidates, self.sids, self.item_meta, evidence)

    def prompt_messages(self, req: RerankRequest) -> list[dict]:
        return render_prompt_within_budget(self.tokenizer, self.max_prompt_tokens, *self._prompt_inputs(req),
                                           profile=self.profile, candidate_order=self.candidate_order)

    def _encode(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, req: RerankRequest, max_new_tokens: int | None = None) -> list[int]:
        """The prompt as the data builder rendered it. The common case (it fits the budget) is
        rendered and tokenized once; only an overlong prompt goes through the trimming loop (oldest
        history first). With `max_new_tokens`, the budget is also what the model's context leaves
        (prompt_limit), and a prompt that cannot fit is a ValueError naming that limit."""
        budget = self.max_prompt_tokens if max_new_tokens is None else self.prompt_limit(max_new_tokens)
        inputs = self._prompt_inputs(req)
        kw = dict(profile=self.profile, candidate_order=self.candidate_order)
        ids = self._encode(render_prompt_messages(*inputs, **kw))
        if len(ids) <= budget:
            return ids
        if budget < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                             f"context of max_position_embeddings={self.max_positions} tokens")
        try:
            return self._encode(render_prompt_within_budget(self.tokenizer, budget, *inputs, **kw))
        except ValueError:
            n = len(self._encode(render_prompt_messages(*inputs, 1, **kw)))
            raise ValueError(f"the prompt needs {n} tokens with one history item, over the limit of {budget}: "
                             f"min(max_prompt_tokens={self.max_prompt_tokens}, max_position_embeddings="
                             f"{self.max_positions} - max_new_tokens={max_new_tokens})") from None

    def decode(self, prompts: list[list[int]], options: DecodeOptions):
        """Token ids per row and the number of forward passes (the raw decoder call), with the
        matmuls in options.compute_dtype."""
        with compute_precision(self.model.device, options.compute_dtype):
            return self._decode(prompts, options)

    def _decode(self, prompts: list[list[int]], options: DecodeOptions):
        gen = torch.Generator(device=self.model.device).manual_seed(options.seed)
        if options.decoder == "ar":
            res = ar_decode(self.model, prompts, options.max_new_tokens, self.eos_id, self.pad_id,
                            temperature=options.temperature, generator=gen)
            return res.tokens, res.n_forward, res
        if options.decoder == "ar_lookup":  # greedy only (DecodeOptions.validate): no generator
            res = ar_lookup_decode(self.model, prompts, options.max_new_tokens, self.eos_id, self.pad_id)
            return res.tokens, res.n_forward, res
        if self.diffusion is None:
            raise ValueError("decoder 'diffusion' needs a converted model (dgr2 convert); this one is AR only")
        block = options.block_size or int(self.diffusion["block_size"])
        args = (self.model, prompts, options.max_new_tokens, block, int(self.diffusion["mask_token_id"]), self.eos_id,
                self.pad_id)
        common = dict(tau=options.tau, max_steps_per_block=options.max_steps_per_block,
                      commit_rule=options.commit_rule, hold_eos=options.hold_eos)
        if (options.temperature == 0 and not (options.window or options.reuse_settled or options.lookup_drafts)
                and takes_packed_rows(self.model)):
            # Rows move through their blocks independently: greedy, each row gets the tokens the
            # lockstep decoder gives it (and it alone), without waiting for the batch's slowest row in
            # every block, and its steps are packed (no padding columns; docs/EXPERIMENTS.md). A
            # single row too: the packed step is what `dgr2 speed` times (4% faster a step at batch 1).
            # (An attention implementation packed rows do not take keeps the lockstep decoder.)
            res = diffusion_decode_independent(*args, **common)
        else:
            res = diffusion_decode(*args, **common, temperature=options.temperature, generator=gen,
                                   window=options.window, reuse_settled=options.reuse_settled,
                                   lookup_drafts=options.lookup_drafts)
        return res.tokens, res.n_forward, res

    def rerank(self, requests: list[RerankRequest], options: DecodeOptions | None = None,
               prompts: list[list[int]] | None = None) -> list[RerankResult]:
        """Re-rank a batch in one batched decode. Never returns an invalid permutation. options None:
        the model's recorded settings; prompts: the requests' prompt ids when the caller rendered
        them already (the service does, at its handler)."""
        options = options if options is not None else self.decode_options()
        options.validate()
        if prompts is None:
            prompts = [self.prompt_ids(r) for r in requests]
        t0 = time.perf_counter()
        tokens, n_forward, _ = self.decode(prompts, options)
        seconds = time.perf_counter() - t0
        out = []
        for req, toks in zip(requests, tokens):
            toks = [int(t) for t in toks]
            text = self.tokenizer.decode(toks, skip_special_tokens=False)
            text = text.split(IM_END, 1)[0]
            parsed = parse_ranking(text, [self.sids.sid_string(c) for c in req.candidates])
            order = self.list_order(req) if self.preranker is not None else None
            out.append(RerankResult(
                permutation=permutation_or_fallback(parsed, len(req.candidates), order), valid=parsed.ok,
                fallback=not parsed.ok, failure=parsed.failure, reasoning=split_reasoning(text), text=text,
                generated_tokens=len(toks), forward_passes=n_forward, decode_seconds=seconds, list_order=order))
        return out


def preranker_order(preranker, features, req: RerankRequest, cross_fitted: bool = False) -> list[int]:
    """``req``'s candidate indices in ``preranker``'s order, from the features ``features`` (a
    FeatureContext) computes for the request."""
    n = len(req.candidates)
    if req.scores is None or len(req.scores) != n:
        raise ValueError(f"this model's pre-ranker orders candidates by features of the retriever's scores: "
                         f"the request needs one score per candidate ({n}), got "
                         f"{'none' if req.scores is None else len(req.scores)}")
    x = features.list_features(req.user or "", list(req.history), list(req.candidates), list(req.scores),
                               req.history_len)
    return preranker.orders(x, [n], [req.user], cross_fitted)[0]


class PreRankerOrder:
    """A pre-ranked engine without its language model: every request answered with the pre-ranker's
    order (`dgr2 e2e` runs it as its own row, so what the model adds to that order is shown apart)."""

    recorded = None  # no decode settings: a caller's options are ignored

    def __init__(self, preranker, features):
        self.preranker, self.features = preranker, features

    @classmethod
    def load(cls, data_dir) -> "PreRankerOrder":
        data_dir = Path(data_dir)
        info = json.loads((data_dir / "build_info.json").read_text())
        copurchase, meta = RerankEngine.load_evidence(data_dir, info)
        preranker, features = RerankEngine.load_preranker(data_dir, info, meta, copurchase)
        if preranker is None:
            raise ValueError(f"{data_dir / 'build_info.json'}: the data was built without a pre-ranker "
                             "(candidate_order: retriever)")
        return cls(preranker, features)

    def rerank(self, requests: list[RerankRequest], options=None, prompts=None) -> list[RerankResult]:
        out = []
        for req in requests:
            order = preranker_order(self.preranker, self.features, req)
            out.append(RerankResult(permutation=order, valid=True, fallback=False, failure=None, reasoning="",
                                    text="", generated_tokens=0, forward_passes=0, decode_seconds=0.0,
                                    list_order=order))
        return out


def read_train_sequences(path) -> dict[str, list[str]]:
    """A release bundle's training sequences (gzipped JSON: user -> items, oldest first), checked."""
    import gzip

    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            seqs = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not gzipped JSON of training sequences ({err})") from None
    if not isinstance(seqs, dict) or not all(isinstance(v, list) and all(isinstance(i, str) for i in v)
                                             for v in seqs.values()):
        raise ValueError(f"{path}: expected an object of user id -> list of item ids")
    return seqs
