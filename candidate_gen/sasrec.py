"""SASRec through RecBole's lower-level API (Config / create_dataset / data_preparation / Trainer).

`quick_start` is avoided on purpose: it imports ray and hides the objects we need afterwards (the
dataset's id maps and the trained model). After training, the model is wrapped in `SasrecEncoder`,
which maps raw item ids to RecBole's internal ids and embeds any history prefix, so the FAISS index
and the candidate lists use exactly the vectors RecBole's own `full_sort_predict` scores with.

A trained SASRec is stored as data, never as a pickle (unpickling a file can run code, and these
files are served): `sasrec.safetensors` (the state dict) and `train_info.json` (training seconds and
the `settings` - dataset name, params, seed - from which `recbole_config_dict` rebuilds RecBole's
Config). RecBole's Trainer would pickle its best model, Config included, into `checkpoint_dir`; here
its `_save_checkpoint` keeps the best state dict in memory instead, so no `.pth` is written or read.
The settings are checked before RecBole sees them (`check_settings`): RecBole's Config `eval`s every
string value of a config dict.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .atomic import write_interactions
from .files import atomic_write, atomic_write_text, parse_json_object
from .recbole_compat import recbole_compat

log = logging.getLogger(__name__)

WEIGHTS_NAME = "sasrec.safetensors"  # the state dict, in a run's (or an artifacts') sasrec/ directory
INFO_NAME = "train_info.json"        # {"train_seconds": ..., "settings": {"dataset", "params", "seed"}}
LEGACY_NAME = "sasrec.pth"           # what older runs wrote: a pickle, never loaded

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


# ------------------------------------------------------------ stored settings and weights
_NAME = re.compile(r"[^/\\\x00]{1,100}")  # a dataset name: one path component (not "." or "..")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# RecBole's Config `eval`s each top-level string of a config dict: allow only what evaluates without
# a call, subscript or string literal (names like "gelu", numbers like "1e-3").
_SAFE_STR = re.compile(r"[A-Za-z0-9_.+\-]{0,64}")
# Keys that name the model, the data, files or directories, or start distributed training.
_DENIED_KEYS = {"model", "dataset", "gpu_id", "nproc", "world_size", "ip", "port", "offset", "local_rank",
                "config_files"}
_DENIED_SUFFIXES = ("_path", "_dir", "_file", "_filename", "_files")


def _check_value(value, where: str, top: bool) -> None:
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: expected a finite number, got {value!r}")
        return
    if isinstance(value, str):
        if top and (not _SAFE_STR.fullmatch(value) or "__" in value):
            raise ValueError(f"{where}: {value!r:.80} is not a plain name or number (RecBole would evaluate it)")
        return
    if isinstance(value, list):
        for k, v in enumerate(value):
            _check_value(v, f"{where}[{k}]", False)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string")
            _check_value(v, f"{where}.{k}", False)
        return
    raise ValueError(f"{where}: unsupported value of type {type(value).__name__}")


def check_settings(settings, source: str = "settings") -> dict:
    """`settings` ({"dataset", "params", "seed"}) if RecBole can be given them safely, else a ValueError
    naming `source` and the field: the dataset is one path component, params are JSON values under
    RecBole-style keys (no file, directory or distributed keys) whose strings evaluate without a call."""
    if not isinstance(settings, dict):
        raise ValueError(f"{source}: settings: expected an object, got {type(settings).__name__}")
    missing = {"dataset", "params", "seed"} - set(settings)
    if missing:
        raise ValueError(f"{source}: settings: missing {', '.join(sorted(missing))}")
    name, params, seed = settings["dataset"], settings["params"], settings["seed"]
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"{source}: settings.dataset: {name!r:.80} is not a dataset name (one path component)")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"{source}: settings.seed: expected an integer, got {seed!r:.40}")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{source}: settings.params: expected an object, got {type(params).__name__}")
    for key, value in (params or {}).items():
        where = f"{source}: settings.params.{key}"
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"{source}: settings.params: {key!r:.80} is not a RecBole setting name")
        if key in _DENIED_KEYS or key.endswith(_DENIED_SUFFIXES):
            raise ValueError(f"{where}: not taken from a stored file (it names a path or a process setting)")
        _check_value(value, where, True)
    return {"dataset": name, "params": params, "seed": seed}


def read_train_info(path: str | os.PathLike) -> dict:
    """train_info.json as a dict; its settings, when present, checked (`check_settings`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; re-run `dgr2 retrieve` to write the SASRec files")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    info = parse_json_object(text, str(path))
    if "settings" in info:
        info["settings"] = check_settings(info["settings"], str(path))
    return info


def save_weights(path: str | os.PathLike, state_dict: dict) -> Path:
    """A state dict as safetensors, atomically (a temp file beside `path`, then a rename)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A SASRec state dict from `sasrec.safetensors` (or the directory holding it), on the CPU.

    Nothing is unpickled: a `.pth` path, or a directory with only an old `sasrec.pth`, is an error
    saying to re-run `dgr2 retrieve`; an unreadable file is a ValueError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS_NAME
    if path.suffix in (".pth", ".pt", ".bin", ".ckpt"):
        raise ValueError(f"{path}: a pickled PyTorch checkpoint, which is not loaded (unpickling a file can run "
                         f"code); SASRec weights are {WEIGHTS_NAME} now: re-run `dgr2 retrieve` to write them and "
                         f"point at {path.with_name(WEIGHTS_NAME)}")
    if not path.is_file():
        legacy = path.with_name(LEGACY_NAME)
        if legacy.exists():
            raise FileNotFoundError(f"{path}: missing; {legacy} is an old pickled checkpoint, which is not loaded "
                                    f"(unpickling a file can run code): re-run `dgr2 retrieve` to write {WEIGHTS_NAME}")
        raise FileNotFoundError(f"{path}: missing; run `dgr2 retrieve` to train SASRec")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not a readable safetensors file ({reason}); re-run `dgr2 retrieve` "
                         "to write it again") from None


def load_state_into(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """`load_weights(path)` into `model`; weights that do not fit are a ValueError naming the file."""
    state = load_weights(path)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: the weights do not fit the SASRec model its settings build "
                         f"({str(e).splitlines()[0]})") from None


def save_trained(run_dir: Path, state_dict: dict, settings: dict, train_seconds: float) -> Path:
    """sasrec.safetensors, then train_info.json (each atomic; a reader that finds the settings finds the
    weights). An old sasrec.pth beside them is removed: nothing may load it later."""
    weights = save_weights(run_dir / WEIGHTS_NAME, state_dict)
    atomic_write_text(run_dir / INFO_NAME, json.dumps({"train_seconds": train_seconds, "settings": settings}))
    (run_dir / LEGACY_NAME).unlink(missing_ok=True)
    return weights


def load_trained(sasrec_dir: str | os.PathLike, data_root: str | os.PathLike, device: str = "cpu"):
    """(RecBole SASRec in eval mode, RecBole dataset) from a run's sasrec/ directory: the Config rebuilt
    from train_info.json's settings (`recbole_config_dict`, paths replaced by `data_root` and
    `sasrec_dir`), the dataset from `data_root/<dataset>`, the weights from sasrec.safetensors."""
    sasrec_dir, data_root = Path(sasrec_dir), Path(data_root)
    weights = sasrec_dir / WEIGHTS_NAME
    if not weights.is_file():
        load_weights(weights)  # raises the right error (missing, or only an old pickle)
    info = read_train_info(sasrec_dir / INFO_NAME)
    if "settings" not in info:
        raise ValueError(f"{sasrec_dir / INFO_NAME}: no settings recorded; re-run `dgr2 retrieve`")
    settings = info["settings"]
    name = settings["dataset"]
    if not (data_root / name).is_dir():
        raise FileNotFoundError(f"{data_root / name}: missing; the retrieval artifacts lack the RecBole dataset copy")
    cfg = recbole_config_dict(data_root, sasrec_dir, settings["params"], settings["seed"])
    cfg.update(use_gpu=device != "cpu", save_dataset=False, save_dataloaders=False, show_progress=False)
    with recbole_compat():
        from recbole.config import Config
        from recbole.data import create_dataset
        from recbole.model.sequential_recommender import SASRec

        config = Config(model="SASRec", dataset=name, config_dict=cfg)
        config["device"] = torch.device(device)
        dataset = create_dataset(config)
        model = SASRec(config, dataset)
        load_state_into(model, weights)
    return model.to(device).eval(), dataset


# ------------------------------------------------------------ training
def _reuse_checkpoint(done: Path, info_path: Path, settings: dict, model, device) -> float | None:
    """Load a finished SASRec (`done`, sasrec.safetensors) into `model` if it was trained with these
    settings; returns its training seconds, or None (train again). Weights from before settings were
    recorded are reused only if they fit the model, and the settings are recorded then (a later load
    rebuilds the Config from them). An old pickled sasrec.pth is never loaded."""
    if not done.exists():
        if done.with_name(LEGACY_NAME).exists():
            log.warning("%s is an old pickled SASRec checkpoint, which is not loaded; training again",
                        done.with_name(LEGACY_NAME))
        return None
    try:
        info = read_train_info(info_path) if info_path.exists() else {}
    except ValueError as e:
        log.warning("%s; training again", e)
        return None
    if "settings" in info and info["settings"] != settings:
        log.warning("SASRec checkpoint %s was trained with other settings; training again", done)
        return None
    try:
        load_state_into(model, done)
    except ValueError as e:
        log.warning("SASRec checkpoint %s does not load (%s); training again", done, e)
        return None
    if "settings" not in info:
        atomic_write_text(info_path, json.dumps({**info, "settings": settings}))
    log.info("reusing trained SASRec checkpoint %s", done)
    return float(info.get("train_seconds", 0.0))


def _keep_best_in_memory(trainer) -> dict:
    """Make `trainer` keep its best model's state dict in the returned dict (a CPU copy) instead of
    pickling it to `saved_model_file`; `fit` saves exactly when the validation score improves."""
    best: dict = {}

    def keep(epoch, verbose=True, **kwargs):
        best["epoch"] = epoch
        best["state_dict"] = {k: v.detach().to("cpu", copy=True) for k, v in trainer.model.state_dict().items()}

    trainer._save_checkpoint = keep
    return best


def _fit(trainer, train_data, valid_data, show_progress: bool) -> None:
    """`trainer.fit` with one bar of ours over the epochs (the validation score beside it) in place
    of RecBole's two bars per epoch (its per-epoch log lines are dropped by recbole_compat), then
    one log line: what the user waits on, without a screen of bars per SASRec model."""
    from tqdm.auto import tqdm

    metric, epochs = trainer.config["valid_metric"], [0]
    with tqdm(total=trainer.epochs, desc="SASRec epochs", unit="epoch", leave=False,
              disable=not show_progress) as bar:
        def epoch_done(epoch_idx, valid_score):
            bar.set_postfix_str(f"valid {metric} {valid_score:.4f}", refresh=False)
            bar.update(epoch_idx + 1 - epochs[0])
            epochs[0] = epoch_idx + 1

        trainer.fit(train_data, valid_data, saved=True, show_progress=False, callback_fn=epoch_done)
    log.info("SASRec: %d of at most %d epochs, best valid %s %.4f", epochs[0], trainer.epochs, metric,
             trainer.best_valid_score)


def train_sasrec(data_root: Path, name: str, run_dir: Path, params: dict, seed: int = 0,
                 evaluate: bool = True) -> SasrecRun:
    """Train SASRec on `<data_root>/<name>`; resumes nothing but reuses a finished checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    done = run_dir / WEIGHTS_NAME
    settings = json.loads(json.dumps({"dataset": name, "params": params, "seed": seed}, default=str))
    check_settings(settings, f"SASRec settings for {run_dir}")  # what a later load will accept
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
        reused = _reuse_checkpoint(done, run_dir / INFO_NAME, settings, model, config["device"])
        if reused is not None:
            train_seconds = reused
        else:
            best = _keep_best_in_memory(trainer)
            _fit(trainer, train_data, valid_data, show_progress=config["show_progress"])
            if "state_dict" in best:
                model.load_state_dict(best["state_dict"])
            else:  # fit saved nothing (no epoch ran): the weights as they are
                log.warning("SASRec training recorded no best model; keeping the last weights")
            train_seconds = time.time() - t0
            save_trained(run_dir, model.state_dict(), settings, train_seconds)
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
