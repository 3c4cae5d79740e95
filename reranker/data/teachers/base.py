"""The one interface every reasoning-trace teacher implements, and GR2's rejection loop.

GR2 makes its SFT traces by rejection sampling: the trace generator never sees the answer; it
proposes (reasoning, ranking) samples and the answer is used only to accept one whose ranking
puts the target first. Here the target lives inside an :class:`Oracle` that answers exactly two
questions (accept this ranking? / move the target first for the counted fallback), so a teacher
cannot read it by accident, and a test can swap targets and check that the proposals stay the same.
"""
from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm


class Oracle:
    """Holds a target candidate index; only answers accept / targeted-fallback questions."""

    __slots__ = ("_target",)

    def __init__(self, target_index: int):
        self._target = int(target_index)

    def accept(self, ranking: Sequence[int]) -> bool:
        """GR2's accept rule: the ranking puts the target first."""
        return len(ranking) > 0 and int(ranking[0]) == self._target

    def targeted(self, order: Sequence[int]) -> list[int]:
        """The fallback ranking: the target first, every other candidate in ``order``."""
        return [self._target] + [int(i) for i in order if int(i) != self._target]

    def __repr__(self) -> str:  # never print the target into logs or traces
        return "Oracle(<hidden>)"


@dataclass
class TeachExample:
    """What a teacher may see: the request (as the prompt shows it) plus the oracle."""

    user: str
    position: int
    history: list[str]            # time ordered, oldest first
    candidates: list[str]         # retriever order
    candidate_sids: list[str]
    scores: list[float]
    evidence: list[dict]          # reranker.data.evidence.candidates_evidence, candidate order
    shown_history: int            # how many recent history items the prompt shows
    oracle: Oracle
    features: np.ndarray | None = None  # reranker.data.features rows for the learned scorer


@dataclass(frozen=True)
class TeacherOutput:
    reasoning: str
    ranking: tuple[int, ...]      # candidate indices, best first
    accepted: bool                # a proposal passed the accept rule
    tries: int                    # proposals examined
    fallback: bool                # no proposal accepted: the targeted fallback was used
    teacher: str = ""
    info: dict = field(default_factory=dict)  # teacher-specific (e.g. parse failure kinds)

    def as_dict(self) -> dict:
        return {"name": self.teacher, "accepted": self.accepted, "tries": self.tries,
                "fallback": self.fallback, **({"info": self.info} if self.info else {})}


class Teacher(ABC):
    name = "teacher"

    @abstractmethod
    def teach(self, example: TeachExample) -> TeacherOutput:
        """One trace and ranking for ``example``."""

    def teach_many(self, examples: Sequence[TeachExample], desc: str = "teaching") -> list[TeacherOutput]:
        """Teach every example (teachers with batched models override this)."""
        return [self.teach(e) for e in tqdm(examples, desc=desc, unit="ex", leave=False, mininterval=2.0)]


def rejection_sample(propose: Callable[[int], Sequence[int]], oracle: Oracle,
                     max_tries: int) -> tuple[list[int] | None, int]:
    """Call ``propose(try_index)`` until the oracle accepts, at most ``max_tries`` times.

    Returns (accepted ranking or None, tries used). ``propose`` gets only the try index: it
    cannot depend on the target.
    """
    if max_tries < 1:
        raise ValueError(f"max_tries must be >= 1, got {max_tries}")
    for k in range(max_tries):
        ranking = [int(i) for i in propose(k)]
        if oracle.accept(ranking):
            return ranking, k + 1
    return None, max_tries


def example_seed(seed: int, user: str, position: int) -> list[int]:
    """A per-example seed that does not depend on the processing order (stable across runs,
    unlike Python's salted hash()), so adding or dropping other examples changes nothing here."""
    return [int(seed), zlib.crc32(str(user).encode("utf-8")), int(position)]


def teacher_stats(outputs: Sequence[TeacherOutput]) -> dict:
    """Acceptance / fallback rates and the distribution of tries."""
    n = len(outputs)
    acc = sum(o.accepted for o in outputs)
    fb = sum(o.fallback for o in outputs)
    tries = Counter(o.tries for o in outputs if o.accepted)
    return {
        "examples": n,
        "accepted": acc,
        "fallback": fb,
        "acceptance_rate": acc / n if n else 0.0,
        "fallback_rate": fb / n if n else 0.0,
        "mean_tries_when_accepted": (sum(k * c for k, c in tries.items()) / acc) if acc else 0.0,
        "tries_when_accepted": {str(k): tries[k] for k in sorted(tries)},
    }
