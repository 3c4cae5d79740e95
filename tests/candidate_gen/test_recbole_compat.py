"""RecBole's chatter is dropped inside `recbole_compat()` and only there: its FutureWarnings, its
root-logger INFO lines, its "command line args ... will not be used" warning and its per-epoch bars
(our own epoch bar and log line stay)."""
import logging
import subprocess
import sys
import warnings
from pathlib import Path

from candidate_gen.recbole_compat import recbole_compat

TINY_SASREC = {"epochs": 2, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 1,
               "train_batch_size": 256, "MAX_ITEM_LIST_LENGTH": 20}


def test_the_block_drops_recbole_chatter_and_nothing_else(caplog):
    ours = logging.getLogger("candidate_gen.sasrec")
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recbole_compat():
            logging.getLogger().info("epoch 0 training [time: 1s]")  # RecBole logs to the root logger
            logging.getLogger().warning("command line args [pipeline --config x.yaml] will not be used in RecBole")
            logging.getLogger().warning("a RecBole warning that matters")
            ours.info("a line of ours")
            warnings.warn_explicit("chained assignment", FutureWarning, "dataset.py", 648,
                                   module="recbole.data.dataset.dataset")
            warnings.warn("a FutureWarning of ours", FutureWarning)
        logging.getLogger().info("the root logger after the block")
        warnings.warn_explicit("after the block", FutureWarning, "dataset.py", 650,
                               module="recbole.data.dataset.dataset")
    assert [r.getMessage() for r in caplog.records] == [
        "a RecBole warning that matters", "a line of ours", "the root logger after the block"]
    assert [str(w.message) for w in caught] == ["a FutureWarning of ours", "after the block"]
    assert not logging.getLogger().filters  # removed on exit


def test_sasrec_training_is_quiet(tmp_path, tiny_catalog, capfd, caplog, monkeypatch):
    """A real SASRec training (Config, create_dataset, data_preparation, Trainer.fit and evaluate),
    run from a dgr2-like command line."""
    from candidate_gen.retrieve import RetrievalSettings, run_retrieval

    monkeypatch.setattr(sys, "argv", ["dgr2", "pipeline", "--config", "configs/x.yaml"])
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_retrieval(RetrievalSettings(out=tmp_path / "r", data_dir=tiny_catalog, sasrec=TINY_SASREC,
                                        crossfit_folds=0))
    err = capfd.readouterr().err
    assert [str(w.message)[:80] for w in caught if "recbole" in w.filename] == []
    assert [r.getMessage()[:80] for r in caplog.records if r.name == "root"] == []
    assert "will not be used in RecBole" not in caplog.text + err
    assert "Train     0" not in err and "Evaluate   " not in err  # RecBole's bars
    assert any(r.name == "candidate_gen.sasrec" and r.getMessage().startswith("SASRec: 2 of at most 2 epochs")
               for r in caplog.records)


def test_recbole_model_imports_leave_torch_anomaly_detection_off():
    """RecBole's sine.py turns torch's anomaly detection on for the whole process when its model
    package is imported (every later backward then ran 2.2x slower). In a fresh interpreter (this
    one may have imported it already), importing it through either of our entry points leaves the
    mode as it was."""
    code = ("import torch\n"
            "from candidate_gen.recbole_compat import recbole_compat\n"
            "with recbole_compat():\n"
            "    import recbole.model.sequential_recommender\n"
            "import recbole.model.sequential_recommender.sine\n"
            "a = torch.is_anomaly_enabled()\n"
            "import importlib, sys\n"
            "for m in [m for m in sys.modules if m.startswith('recbole.model')]:\n"
            "    del sys.modules[m]\n"
            "import integration.recbole_model\n"
            "print(a, torch.is_anomaly_enabled())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout
