"""No pickle is loaded from a served or user-supplied file (issue 22): SASRec is stored as safetensors +
JSON settings, a crafted `.pth` (or RecBole dataset cache) in a retrieval directory never runs, and
corrupt or hostile files give an error naming the file."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from candidate_gen.retrieve import RetrievalSettings, run_retrieval
from candidate_gen.sasrec import _reuse_checkpoint, load_weights

REPO = Path(__file__).resolve().parents[1]
TINY_SASREC = {"epochs": 2, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 1,
               "train_batch_size": 256, "MAX_ITEM_LIST_LENGTH": 20}


class Payload:
    """Unpickling this writes `marker`: what a crafted checkpoint would do, harmlessly."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def craft(path: Path, marker: Path) -> Path:
    """A torch checkpoint shaped like RecBole's (config + state_dict) whose unpickling writes `marker`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": Payload(marker), "state_dict": {}}, path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_catalog):
    out = tmp_path_factory.mktemp("np") / "r"
    run_retrieval(RetrievalSettings(out=out, data_dir=tiny_catalog, sasrec=TINY_SASREC, crossfit_folds=0))
    return out


@pytest.fixture
def copy_of(trained, tmp_path):
    d = tmp_path / "r"
    shutil.copytree(trained, d)
    return d


def test_the_crafted_file_would_run_code(tmp_path):
    """The payload is real: the old load (weights_only=False) runs it."""
    marker = tmp_path / "marker"
    torch.load(craft(tmp_path / "x.pth", marker), weights_only=False)
    assert marker.read_text() == "ran"


def test_trained_dir_is_data_only_and_serves_the_same_candidates(trained):
    from reranker.service.retrieval import Retriever

    assert not list(trained.rglob("*.pth")), "a pickle was left behind"
    assert (trained / "sasrec" / "sasrec.safetensors").is_file()
    settings = json.loads((trained / "sasrec" / "train_info.json").read_text())["settings"]
    assert settings == {"dataset": "tiny", "params": TINY_SASREC, "seed": 0}
    retriever = Retriever.load(trained)
    seqs = json.loads((trained / "sequences.json").read_text())
    rows = [json.loads(line) for line in (trained / "candidates" / "test.jsonl").open()][:40]
    for row in rows:  # the lists training wrote from the in-process model
        items, scores = retriever.retrieve(seqs[row["user"]][: row["position"]], 10)
        assert list(items) == row["candidates"]
        assert list(scores) == pytest.approx(row["scores"], rel=1e-5, abs=1e-6)


def test_a_dir_with_only_an_old_pth_is_refused_without_running_it(copy_of, tmp_path):
    from reranker.service.retrieval import Retriever

    marker = tmp_path / "marker"
    (copy_of / "sasrec" / "sasrec.safetensors").unlink()
    legacy = craft(copy_of / "sasrec" / "sasrec.pth", marker)
    with pytest.raises(FileNotFoundError, match=re.escape(str(legacy)) + r".*re-run `dgr2 retrieve`"):
        Retriever.load(copy_of)
    assert not marker.exists()


def test_the_service_entry_point_reports_an_old_pth_in_one_line(copy_of, tmp_path, caplog, monkeypatch):
    """`serve --retrieval DIR` logs the error and exits 1: no traceback, nothing run."""
    from reranker.service import server

    marker = tmp_path / "marker"
    (copy_of / "sasrec" / "sasrec.safetensors").unlink()
    craft(copy_of / "sasrec" / "sasrec.pth", marker)

    class NoEngine:
        @staticmethod
        def load(*args, **kwargs):
            return object()

    monkeypatch.setattr("reranker.engine.RerankEngine", NoEngine)  # only the retriever is under test
    rc = server.main(["--model", str(tmp_path), "--data", str(tmp_path), "--retrieval", str(copy_of)])
    assert rc == 1 and not marker.exists()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert errors and "sasrec.pth" in errors[-1].getMessage() and errors[-1].exc_info is None


def test_a_pth_beside_the_safetensors_is_never_read(copy_of, tmp_path):
    from reranker.service.retrieval import Retriever

    marker = tmp_path / "marker"
    craft(copy_of / "sasrec" / "sasrec.pth", marker)
    craft(copy_of / "sasrec" / "SASRec-Jan-01-2025_00-00-00.pth", marker)  # RecBole's own naming
    Retriever.load(copy_of)
    assert not marker.exists()


def test_a_crafted_recbole_dataset_cache_is_refused(copy_of, tmp_path):
    """RecBole's create_dataset unpickles <checkpoint_dir>/<dataset>-SequentialDataset.pth if present."""
    from reranker.service.retrieval import Retriever

    marker = tmp_path / "marker"
    cache = copy_of / "sasrec" / "tiny-SequentialDataset.pth"
    cache.write_bytes(__import__("pickle").dumps(Payload(marker)))
    with pytest.raises(ValueError, match=re.escape(str(cache)) + ".*not loaded"):
        Retriever.load(copy_of)
    assert not marker.exists()


def test_a_crafted_dataloader_cache_is_refused(tmp_path):
    import pickle

    from candidate_gen.recbole_compat import recbole_compat

    marker = tmp_path / "marker"
    cache = tmp_path / "tiny-for-SASRec-dataloader.pth"
    cache.write_bytes(pickle.dumps(Payload(marker)))
    config = {"checkpoint_dir": str(tmp_path), "dataset": "tiny", "model": "SASRec", "dataloaders_save_path": None}
    with recbole_compat():
        from recbole.data.utils import load_split_dataloaders

        with pytest.raises(ValueError, match=re.escape(str(cache))):
            load_split_dataloaders(config)
    assert not marker.exists()
    import recbole.data.utils as rb

    assert rb.pickle is pickle  # restored after the block


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 64, "truncate"])
def test_a_corrupt_safetensors_file_is_named(copy_of, content):
    from reranker.service.retrieval import Retriever

    weights = copy_of / "sasrec" / "sasrec.safetensors"
    if content == "truncate":
        content = weights.read_bytes()[:200]
    weights.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(weights)) + ".*safetensors"):
        Retriever.load(copy_of)


def test_weights_that_do_not_fit_are_named(copy_of):
    from safetensors.torch import save_file

    from reranker.service.retrieval import Retriever

    weights = copy_of / "sasrec" / "sasrec.safetensors"
    save_file({"item_embedding.weight": torch.zeros(3, 3)}, str(weights))
    with pytest.raises(ValueError, match=re.escape(str(weights)) + ".*do not fit"):
        Retriever.load(copy_of)


@pytest.mark.parametrize("edit, field", [
    (lambda s, m: s["params"].update(hidden_act=f"open({str(m)!r}, 'w').write('ran')"), "settings.params.hidden_act"),
    (lambda s, m: s["params"].update(hidden_act="__import__"), "settings.params.hidden_act"),
    (lambda s, m: s["params"].update(dataset_save_path=str(m)), "settings.params.dataset_save_path"),
    (lambda s, m: s.update(dataset="../../elsewhere"), "settings.dataset"),
    (lambda s, m: s.update(seed="0"), "settings.seed"),
])
def test_hostile_settings_are_refused_before_recbole_sees_them(copy_of, tmp_path, edit, field):
    """RecBole's Config evals every string of a config dict: a stored setting must not reach it unchecked."""
    from reranker.service.retrieval import Retriever

    marker = tmp_path / "marker"
    info_path = copy_of / "sasrec" / "train_info.json"
    info = json.loads(info_path.read_text())
    edit(info["settings"], marker)
    info_path.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=re.escape(f"{info_path}: {field}")):
        Retriever.load(copy_of)
    assert not marker.exists()


def test_training_never_loads_an_old_pth(tmp_path):
    marker = tmp_path / "marker"
    craft(tmp_path / "sasrec.pth", marker)
    info = tmp_path / "train_info.json"
    settings = {"dataset": "d", "params": {}, "seed": 0}
    info.write_text(json.dumps({"train_seconds": 1.0, "settings": settings}))
    assert _reuse_checkpoint(tmp_path / "sasrec.safetensors", info, settings, torch.nn.Linear(2, 2), "cpu") is None
    assert not marker.exists()


def test_the_recbole_model_key_refuses_a_pth(tmp_path):
    """`sasrec_checkpoint` (integration/recbole_model.py) goes through load_weights."""
    marker = tmp_path / "marker"
    legacy = craft(tmp_path / "sasrec" / "sasrec.pth", marker)
    with pytest.raises(ValueError, match=re.escape(str(legacy)) + r".*not loaded.*dgr2 retrieve"):
        load_weights(legacy)
    with pytest.raises(FileNotFoundError, match=re.escape(str(legacy)) + r".*dgr2 retrieve"):
        load_weights(legacy.parent)  # the directory, with only the old pickle
    assert not marker.exists()


def test_no_unsafe_loads_in_the_source():
    """No weights_only=False, no pickle loads, and every torch.load says weights_only=True."""
    offenders = []
    for pkg in ("reranker", "candidate_gen", "integration"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = path.relative_to(REPO)
            if re.search(r"weights_only\s*=\s*False", text):
                offenders.append(f"{rel}: weights_only=False")
            if re.search(r"\b(c?pickle|dill|joblib)\.loads?\(", text):
                offenders.append(f"{rel}: pickle load")
            if re.search(r"allow_pickle\s*=\s*True", text):
                offenders.append(f"{rel}: allow_pickle=True")
            for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
                if not re.search(r"weights_only\s*=\s*True", m.group(1)):
                    offenders.append(f"{rel}: {m.group(0)}")
    assert not offenders, offenders
