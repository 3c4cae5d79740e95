"""Recommend's first stage: history -> SASRec user vector -> FAISS top-N (history excluded).

Loads a retrieval artifacts directory (`dgr2 retrieve`): sasrec/sasrec.pth (a RecBole checkpoint,
which pickles RecBole's Config), index/ (ItemIndex) and data/<name>/<name>.inter. RecBole builds a
model only from a dataset (item count and id map), so the dataset is rebuilt from the artifacts'
own data/ copy; training is never run. Paths in the stored config are replaced by the artifacts
directory's, so the directory can be moved.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from candidate_gen.index import ItemIndex
from candidate_gen.recbole_compat import recbole_compat
from candidate_gen.sasrec import SasrecEncoder

log = logging.getLogger(__name__)


def load_sasrec(artifacts_dir: str | Path, device: str = "cpu"):
    """(RecBole SASRec model in eval mode, RecBole dataset) from an artifacts directory."""
    d = Path(artifacts_dir)
    ckpt = d / "sasrec" / "sasrec.pth"
    if not ckpt.exists():
        raise FileNotFoundError(f"{ckpt}: missing; run `dgr2 retrieve` (a finished run renames its checkpoint "
                                "to sasrec.pth)")
    with recbole_compat():
        from recbole.data import create_dataset
        from recbole.model.sequential_recommender import SASRec

        state = torch.load(ckpt, map_location="cpu")  # recbole_compat allows RecBole's pickled config
        config = state["config"]
        data_path = d / "data" / config["dataset"]
        if not data_path.is_dir():
            raise FileNotFoundError(f"{data_path}: missing; the retrieval artifacts lack the RecBole dataset copy")
        config["data_path"] = str(data_path)
        config["checkpoint_dir"] = str(d / "sasrec")
        config["dataset_save_path"] = None
        config["save_dataset"] = False
        config["device"] = torch.device(device)
        config["use_gpu"] = device != "cpu"
        dataset = create_dataset(config)
        model = SASRec(config, dataset)
        model.load_state_dict(state["state_dict"])
    return model.to(device).eval(), dataset


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
