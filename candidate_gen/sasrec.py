"""SASRec through RecBole's lower-level API (Config / create_dataset / data_preparation / Trainer).

`quick_start` is avoided on purpose: it imports ray and hides the objects we need afterwards (the
dataset's id maps and the trained model). After training, the model is wrapped in `SasrecEncoder`,
which maps raw item ids to RecBole's internal ids and embeds any history prefix, so the FAISS index
and the candidate lists use exactly the vectors RecBole's own `full_sort_predict` scores with.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .atomic import write_interactions
from .recbole_compat import recbole_compat

log = logging.getLogger(__name__)

# Settings a user may override from the YAML config (`sasrec:` section); RecBole's own names.
DEFAULT_SASREC = {
    "hidden_size": 64,
    "inner_size": 256,
    "n_layers": 2,
    "n_heads": 2,
    "hidden_dropout_prob": 0.5,
    "attn_dropout_prob": 0.5,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "initializer_range": 0.02,
    "loss_type": "CE",
    "MAX_ITEM_LIST_LENGTH": 50,
    "learning_rate": 0.001,
    "train_batch_size": 2048,
    "eval_batch_size": 4096,
    "epochs": 10,
    "stopping_step": 3,
}


def write_recbole_dataset(root: Path, name: str, seqs: dict[str, list[str]]) -> Path:
    """Write validated sequences as `<root>/<name>/<name>.inter` for RecBole.

    Timestamps are rewritten as each interaction's rank in our (timestamp, file order) sort, so
    RecBole's time ordering is exactly ours even where the source has ties.
    """
    users, items, stamps = [], [], []
    k = 0
    for u in sorted(seqs):
        for i in seqs[u]:
            users.append(u)
            items.append(i)
            stamps.append(float(k))
            k += 1
    write_interactions(root / name / f"{name}.inter", users, items, stamps)
    return root


def recbole_config_dict(data_root: Path, run_dir: Path, params: dict, seed: int) -> dict:
    p = {**DEFAULT_SASREC, **(params or {})}
    return {
        **p,
        "data_path": str(data_root),
        "checkpoint_dir": str(run_dir),
        "load_col": {"inter": ["user_id", "item_id", "timestamp"]},
        "eval_args": {"split": {"LS": "valid_and_test"}, "order": "TO", "mode": "full", "group_by": "user"},
        "train_neg_sample_args": None,
        "metrics": ["Recall", "NDCG"],
        "topk": [10],
        "valid_metric": "NDCG@10",
        "use_gpu": torch.cuda.is_available(),
        "seed": seed,
        "reproducibility": True,
        "show_progress": True,
        "worker": 0,
        "log_wandb": False,
        "save_dataset": False,
        "save_dataloaders": False,
    }


@dataclass
class SasrecRun:
    model: torch.nn.Module
    dataset: object  # RecBole dataset
    test_data: object
    config: object
    checkpoint: Path
    train_seconds: float
    test_result: dict


def _reuse_checkpoint(done: Path, info_path: Path, settings: dict, model, device) -> float | None:
    """Load a finished SASRec checkpoint into `model` if it was trained with these settings; returns
    its training seconds, or None (train again). A checkpoint from before settings were recorded is
    reused only if its weights fit the model (a changed size used to load silently or crash)."""
    if not done.exists():
        return None
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if "settings" in info and info["settings"] != settings:
        log.warning("SASRec checkpoint %s was trained with other settings; training again", done)
        return None
    state = torch.load(done, map_location=device)
    try:
        model.load_state_dict(state["state_dict"])
    except RuntimeError as e:
        log.warning("SASRec checkpoint %s does not fit the configured model (%s); training again",
                    done, str(e).splitlines()[0])
        return None
    log.info("reusing trained SASRec checkpoint %s", done)
    return float(info.get("train_seconds", 0.0))


def train_sasrec(data_root: Path, name: str, run_dir: Path, params: dict, seed: int = 0,
                 evaluate: bool = True) -> SasrecRun:
    """Train SASRec on `<data_root>/<name>`; resumes nothing but reuses a finished checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    done = run_dir / "sasrec.pth"
    with recbole_compat(tensorboard_dir=str(run_dir / "tensorboard")):
        from recbole.config import Config
        from recbole.data import create_dataset, data_preparation
        from recbole.model.sequential_recommender import SASRec
        from recbole.trainer import Trainer
        from recbole.utils import init_seed

        config = Config(model="SASRec", dataset=name, config_dict=recbole_config_dict(data_root, run_dir, params, seed))
        init_seed(config["seed"], config["reproducibility"])
        dataset = create_dataset(config)
        train_data, valid_data, test_data = data_preparation(config, dataset)
        init_seed(config["seed"], config["reproducibility"])
        model = SASRec(config, train_data.dataset).to(config["device"])
        trainer = Trainer(config, model)
        t0 = time.time()
        settings = json.loads(json.dumps({"dataset": name, "params": params, "seed": seed}, default=str))
        reused = _reuse_checkpoint(done, run_dir / "train_info.json", settings, model, config["device"])
        if reused is not None:
            train_seconds = reused
        else:
            trainer.fit(train_data, valid_data, saved=True, show_progress=config["show_progress"])
            state = torch.load(trainer.saved_model_file, map_location=config["device"])
            model.load_state_dict(state["state_dict"])
            train_seconds = time.time() - t0
            Path(trainer.saved_model_file).replace(done)
            (run_dir / "train_info.json").write_text(json.dumps({"train_seconds": train_seconds, "settings": settings}))
        model.eval()
        test_result = {}
        if evaluate:
            trainer.model = model
            test_result = dict(trainer.evaluate(test_data, load_best_model=False, show_progress=False))
    return SasrecRun(model, dataset, test_data, config, done, train_seconds,
                     {k: float(v) for k, v in test_result.items()})


class SasrecEncoder:
    """Embeds raw-id history prefixes with a trained RecBole SASRec.

    Items the model never saw (possible for cross-fitted fold models) are skipped in a prefix.
    """

    def __init__(self, model: torch.nn.Module, dataset):
        self.model = model.eval()
        self.max_len = int(model.max_seq_length)
        tokens = dataset.field2id_token["item_id"]
        self.token_to_id = {str(t): k for k, t in enumerate(tokens) if k > 0}  # 0 is [PAD]
        self.device = next(model.parameters()).device

    def item_embeddings(self, item_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings in `item_ids` order, known mask); unknown items get a zero row."""
        w = self.model.item_embedding.weight.detach().cpu().numpy().astype(np.float32)
        out = np.zeros((len(item_ids), w.shape[1]), dtype=np.float32)
        known = np.zeros(len(item_ids), dtype=bool)
        for k, i in enumerate(item_ids):
            j = self.token_to_id.get(i)
            if j is not None:
                out[k] = w[j]
                known[k] = True
        return out, known

    @torch.no_grad()
    def encode(self, prefixes: list[list[str]], batch_size: int = 2048) -> np.ndarray:
        """User (sequence) embeddings for each prefix, the vector `full_sort_predict` uses."""
        outs = []
        for b in range(0, len(prefixes), batch_size):
            chunk = prefixes[b:b + batch_size]
            seq = torch.zeros((len(chunk), self.max_len), dtype=torch.long)
            lens = torch.ones(len(chunk), dtype=torch.long)
            for r, prefix in enumerate(chunk):
                ids = [self.token_to_id[i] for i in prefix if i in self.token_to_id][-self.max_len:]
                if ids:
                    seq[r, : len(ids)] = torch.tensor(ids)
                    lens[r] = len(ids)
            out = self.model.forward(seq.to(self.device), lens.to(self.device))
            outs.append(out.cpu().numpy().astype(np.float32))
        return np.concatenate(outs) if outs else np.zeros((0, self.model.hidden_size), np.float32)
