"""Recommend's first stage: history -> SASRec user vector -> FAISS top-N (history excluded).

Loads a retrieval artifacts directory (`dgr2 retrieve`): sasrec/sasrec.safetensors (SASRec's state
dict) with sasrec/train_info.json (the settings RecBole's Config is rebuilt from), index/
(ItemIndex) and data/<name>/<name>.inter. Nothing is unpickled (a served directory's files could be
crafted): a directory with only an old pickled sasrec.pth is an error saying to re-run
`dgr2 retrieve`. RecBole builds a model only from a dataset (item count and id map), so the dataset
is rebuilt from the artifacts' own data/ copy; training is never run. The Config's paths are the
artifacts directory's, so the directory can be moved.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from candidate_gen.index import ItemIndex
from candidate_gen.sasrec import SasrecEncoder, load_trained

log = logging.getLogger(__name__)


def load_sasrec(artifacts_dir: str | Path, device: str = "cpu"):
    """(RecBole SASRec model in eval mode, RecBole dataset) from an artifacts directory."""
    d = Path(artifacts_dir)
    return load_trained(d / "sasrec", d / "data", device)


class Retriever:
    """SASRec encoder + FAISS index; `retrieve` mirrors the candidate lists of `dgr2 retrieve`."""

    def __init__(self, encoder: SasrecEncoder, index: ItemIndex):
        self.encoder = encoder
        self.index = index

    @classmethod
    def load(cls, artifacts_dir: str | Path, device: str = "cpu") -> "Retriever":
        model, dataset = load_sasrec(artifacts_dir, device)
        index = ItemIndex.load(Path(artifacts_dir) / "index")
        log.info("retriever: %d items in the index (%s)", len(index.item_ids), index.kind)
        return cls(SasrecEncoder(model, dataset), index)

    def known(self, item: str) -> bool:
        return item in self.encoder.token_to_id

    def allowed_mask(self, keep) -> np.ndarray:
        """Index rows the re-ranker can take (items with a semantic ID)."""
        return np.array([bool(keep(i)) for i in self.index.item_ids], dtype=bool)

    def retrieve(self, history: list[str], n: int, allowed: np.ndarray | None = None):
        """(items, scores): the top n items for this history, history items excluded."""
        q = self.encoder.encode([history])
        items, scores = self.index.top_n_excluding(q, [set(history)], n, allowed=allowed)
        return items[0], scores[0]
