"""Import reasoning traces written by any external LLM (JSONL), under GR2's accept rule.

Get the prompts from a build's ``train.jsonl`` (fields ``user``, ``position``,
``prompt_messages``; each line's ``candidate_sids`` lists the SIDs in retriever order), have any
LLM write a reasoning and a ranking for each, and save one JSON object per line:

    {"user": "A2V5R832QCSOMX", "position": 17,
     "reasoning": "The user buys nail polish from one brand ... so <|sid_begin|>...<|sid_end|> first.",
     "ranking": ["<|sid_begin|><a_12><b_200><c_7><d_0><|sid_end|>", "B00KHGIK54", ...]}

    user       string  the user id, as in the retrieval artifacts' candidates/*.jsonl
    position   integer the example's position in the user's sequence (same files)
    reasoning  string  the trace: plain text, non-empty, without <think> / </think> markers
    ranking    list    every candidate of that example exactly once, best first; each entry a
                       SID string (as in the prompt) or a raw item id

Several lines for the same (user, position) are several samples, tried in file order (GR2's
rejection sampling done by your LLM). A line is accepted when its ranking is a valid permutation of
the example's candidates AND puts the held-out target first. Rankings that are not permutations
are counted by kind (unparsable / out_of_set / duplicate / dropped), valid ones that miss are
counted as rejected. Examples with no accepted line get the targeted fallback (target first, the
rest in the first valid sample's order, else the retriever's) with a template trace, counted as
fallback. Malformed lines (bad JSON, missing or mistyped fields) stop the import with
``file:line: field ...``.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from candidate_gen.files import iter_jsonl
from reranker.data.teachers.base import Teacher, TeachExample, TeacherOutput
from reranker.data.teachers.traces import TraceWriter, trace_rng
from reranker.text.answer import FAILURE_KINDS, parse_ranking
from reranker.text.sid import SID_BEGIN
from reranker.text.tokenizer import THINK_CLOSE, THINK_OPEN


class TraceFileError(ValueError):
    """A malformed trace file; the message names file, line and field."""


@dataclass(frozen=True)
class ExternalTrace:
    user: str
    position: int
    reasoning: str
    ranking: tuple[str, ...]
    line: int


def load_external_traces(path) -> dict[tuple[str, int], list[ExternalTrace]]:
    """Read and validate a trace JSONL file; (user, position) -> samples in file order."""
    path = Path(path)
    if not path.is_file():
        raise TraceFileError(f"{path}: trace file not found")
    out: dict[tuple[str, int], list[ExternalTrace]] = {}
    for lineno, obj in iter_jsonl(path, error=TraceFileError):
        where = f"{path}:{lineno}"
        for name in ("user", "position", "reasoning", "ranking"):
            if name not in obj:
                raise TraceFileError(f"{where}: field {name!r} is missing")
        user, pos, reasoning, ranking = obj["user"], obj["position"], obj["reasoning"], obj["ranking"]
        if not isinstance(user, str) or not user:
            raise TraceFileError(f"{where}: field 'user': expected a non-empty string, got {user!r:.60}")
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
            raise TraceFileError(f"{where}: field 'position': expected an integer >= 0, got {pos!r:.60}")
        if not isinstance(reasoning, str) or not reasoning.strip():
            raise TraceFileError(f"{where}: field 'reasoning': expected a non-empty string, got {reasoning!r:.60}")
        if THINK_OPEN in reasoning or THINK_CLOSE in reasoning:
            raise TraceFileError(f"{where}: field 'reasoning': must not contain {THINK_OPEN} or {THINK_CLOSE} "
                                 "(the builder adds them)")
        if not isinstance(ranking, list) or not all(isinstance(r, str) for r in ranking):
            raise TraceFileError(f"{where}: field 'ranking': expected a list of strings, got {ranking!r:.80}")
        out.setdefault((user, pos), []).append(
            ExternalTrace(user, pos, reasoning.strip(), tuple(ranking), lineno))
    return out


class JsonlTeacher(Teacher):
    """Serves imported traces through the common interface, with the same accept rule."""

    name = "jsonl"

    def __init__(self, traces: Mapping[tuple[str, int], Sequence[ExternalTrace]] | str | Path, sids,
                 writer: TraceWriter, seed: int = 0, max_tries: int | None = None):
        self.traces = load_external_traces(traces) if isinstance(traces, (str, Path)) else dict(traces)
        self.sids = sids
        self.writer = writer
        self.seed = int(seed)
        self.max_tries = max_tries
        self.counts = Counter({"accepted": 0, "rejected": 0, "missing": 0, "fallback": 0,
                               **{k: 0 for k in FAILURE_KINDS}})
        self._asked: set[tuple[str, int]] = set()

    def _as_sid(self, entry: str) -> str:
        if entry.startswith(SID_BEGIN) or entry not in self.sids:
            return entry  # a SID string, or an unknown id that the parser reports as out_of_set
        return self.sids.sid_string(entry)

    def teach(self, ex: TeachExample) -> TeacherOutput:
        key = (ex.user, int(ex.position))
        self._asked.add(key)
        samples = list(self.traces.get(key, ()))
        if self.max_tries is not None:
            samples = samples[: self.max_tries]
        if not samples:
            self.counts["missing"] += 1
        first_valid = None
        failures: Counter = Counter()
        for k, sample in enumerate(samples):
            res = parse_ranking(json.dumps({"ranking": [self._as_sid(r) for r in sample.ranking]}), ex.candidate_sids)
            if not res.ok:
                self.counts[res.failure] += 1
                failures[res.failure] += 1
                continue
            if ex.oracle.accept(res.permutation):
                self.counts["accepted"] += 1
                return TeacherOutput(sample.reasoning, tuple(res.permutation), True, k + 1, False, self.name,
                                     {"line": sample.line})
            self.counts["rejected"] += 1
            first_valid = first_valid or res.permutation
        self.counts["fallback"] += 1
        order = first_valid or range(len(ex.candidates))
        ranking = ex.oracle.targeted(order)
        reasoning = self.writer.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history,
                                      trace_rng(self.seed, ex.user, ex.position))
        info = {"samples": len(samples), **({"failures": dict(failures)} if failures else {})}
        return TeacherOutput(reasoning, tuple(ranking), False, len(samples), True, self.name, info)

    def report(self) -> dict:
        """Counts over everything taught so far, plus trace lines no example asked for."""
        unused = [k for k in self.traces if k not in self._asked]
        return {**dict(self.counts), "lines": sum(len(v) for v in self.traces.values()),
                "examples_with_traces": len(self.traces) - len(unused),
                "unused_keys": len(unused), "unused_examples_sample": [list(k) for k in unused[:5]]}
