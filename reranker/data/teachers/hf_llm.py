"""A local Hugging Face causal LM as the trace teacher (GR2's teacher was Qwen3-8B).

Any model directory works (AutoModelForCausalLM + AutoTokenizer, ``local_files_only``: nothing is
downloaded). The prompt is the project's prompt (history, candidates in retriever order with
their collaborative evidence) under a system message that asks for GR2's trace principles, then
the JSON ranking. Samples are drawn with the project's AR decoder (KV cache, seeded generator,
``tries_per_batch`` samples decoded as one batch) and checked with reranker.text.answer.parse_ranking;
the first sample that is a valid permutation with the target first is accepted (the target is
seen only by the oracle). Otherwise the targeted fallback with a template trace, counted.
"""
from __future__ import annotations

import re
import zlib
from collections import Counter

import torch

from reranker.data.teachers.base import Teacher, TeachExample, TeacherOutput
from reranker.data.teachers.traces import TraceWriter, trace_rng
from reranker.text.answer import FAILURE_KINDS, parse_ranking
from reranker.text.prompt import render_prompt_messages
from reranker.text.tokenizer import load_tokenizer, THINK_CLOSE, THINK_OPEN

TEACHER_SYSTEM_PROMPT = (
    "You re-rank a recommender's candidates for one user. Items are written as semantic IDs "
    "(<|sid_begin|>...<|sid_end|>). First reason briefly inside <think> </think>: the pattern in the "
    "user's history (categories, brands), which candidates complement the recent purchases, the "
    "evidence for the strongest candidates citing their SIDs (co-purchase counts, brand and category "
    "match, retriever rank), then your decision. After </think> output only JSON "
    "{\"ranking\": [every candidate SID exactly once, best first]}."
)
_THINK_RE = re.compile(re.escape(THINK_OPEN) + r"(.*?)" + re.escape(THINK_CLOSE), re.S)


def split_reasoning(text: str) -> str | None:
    """The reasoning between <think> and </think>, or None when the format is broken."""
    m = _THINK_RE.search(text)
    if m is None:
        return None
    reasoning = m.group(1).strip()
    return reasoning or None


class HfLlmTeacher(Teacher):
    name = "hf_llm"

    def __init__(self, model_dir, sids, items_meta, writer: TraceWriter, max_tries: int = 8,
                 tries_per_batch: int | None = None, temperature: float = 0.8, top_p: float = 0.95,
                 max_new_tokens: int = 384, profile: str = "full", seed: int = 0, device: str | None = None,
                 dtype=None):
        from reranker.model import load_model

        if max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {max_tries}")
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, dtype=dtype).eval()
        if device is not None:
            self.model.to(device)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{model_dir}: the tokenizer defines no eos_token; generation could not stop")
        self.sids, self.meta, self.writer = sids, items_meta, writer
        self.max_tries, self.temperature, self.top_p = int(max_tries), float(temperature), float(top_p)
        self.tries_per_batch = int(tries_per_batch or max_tries)
        self.max_new_tokens, self.profile, self.seed = int(max_new_tokens), profile, int(seed)
        self.counts = Counter({"samples": 0, "accepted": 0, "rejected": 0, "no_reasoning": 0, "fallback": 0,
                               **{k: 0 for k in FAILURE_KINDS}})

    def prompt_ids(self, ex: TeachExample) -> list[int]:
        messages = render_prompt_messages(ex.history, ex.candidates, self.sids, self.meta, ex.evidence,
                                          profile=self.profile)
        messages[0] = {"role": "system", "content": TEACHER_SYSTEM_PROMPT}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _samples(self, ex: TeachExample):
        """Yield decoded samples in order, ``tries_per_batch`` decoded at a time."""
        from reranker.diffusion.ar_decoder import ar_decode

        ids = self.prompt_ids(ex)
        dev = self.model.device
        gen = torch.Generator(device=dev)
        gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(f"{ex.user}|{ex.position}".encode())) % (2**63))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        done = 0
        while done < self.max_tries:
            b = min(self.tries_per_batch, self.max_tries - done)
            res = ar_decode(self.model, [ids] * b, self.max_new_tokens, self.tokenizer.eos_token_id, pad,
                            temperature=self.temperature, top_p=self.top_p, generator=gen)
            for toks in res.tokens:
                yield self.tokenizer.decode(toks, skip_special_tokens=True)
            done += b

    def teach(self, ex: TeachExample) -> TeacherOutput:
        failures: Counter = Counter()
        first_valid = None
        tries = 0
        for text in self._samples(ex):
            tries += 1
            self.counts["samples"] += 1
            res = parse_ranking(text, ex.candidate_sids)
            if not res.ok:
                failures[res.failure] += 1
                self.counts[res.failure] += 1
                continue
            reasoning = split_reasoning(text)
            if reasoning is None:
                failures["no_reasoning"] += 1
                self.counts["no_reasoning"] += 1
                continue
            if ex.oracle.accept(res.permutation):
                self.counts["accepted"] += 1
                return TeacherOutput(reasoning, tuple(res.permutation), True, tries, False, self.name)
            self.counts["rejected"] += 1
            first_valid = first_valid or res.permutation
        self.counts["fallback"] += 1
        ranking = ex.oracle.targeted(first_valid or range(len(ex.candidates)))
        reasoning = self.writer.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history,
                                      trace_rng(self.seed, ex.user, ex.position))
        return TeacherOutput(reasoning, tuple(ranking), False, tries, True, self.name,
                             {"failures": dict(failures)} if failures else {})

    def report(self) -> dict:
        return dict(self.counts)
