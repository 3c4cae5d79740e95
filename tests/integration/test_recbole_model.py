"""SASRec + re-ranker as a RecBole model, evaluated by RecBole's own Trainer.evaluate."""
import re
import time
from pathlib import Path

import pytest

from candidate_gen.retrieve import RetrievalSettings, run_retrieval

TINY_SASREC = {"epochs": 2, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 1,
               "train_batch_size": 256, "MAX_ITEM_LIST_LENGTH": 20}


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory, tiny_catalog):
    out = tmp_path_factory.mktemp("rb") / "r"
    res = run_retrieval(RetrievalSettings(out=out, data_dir=tiny_catalog, sasrec=TINY_SASREC, crossfit_folds=0))
    return out, res


def run_snippet(out, rerank_model=None, rerank_data=None, engine=None, namespace=False, extra=None):
    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    code = re.search(r"<!-- recbole-snippet -->\n```python\n(.*?)```", text, re.S).group(1)
    if extra:  # more config keys than the snippet sets
        code = code.replace("rerank_top_n=10)", "rerank_top_n=10, **EXTRA)")
    if engine is not None:  # inject a ready engine instead of loading one from directories
        code = code.replace("model = SASRecReranked(config, train_data.dataset)",
                            "model = SASRecReranked(config, train_data.dataset, engine=ENGINE)")
    env = {"DATA_ROOT": str(out / "data"), "RUN_DIR": str(out / "rb_eval"), "SASREC_PARAMS": TINY_SASREC,
           "SASREC_CKPT": str(out / "sasrec" / "sasrec.safetensors"), "DATASET": "tiny",
           "RERANK_MODEL": rerank_model, "RERANK_DATA": rerank_data, "ENGINE": engine, "EXTRA": extra or {}}
    exec(compile(code, "README-snippet", "exec"), env)
    return env if namespace else env["result"]


def test_sasrec_alone_matches_faiss_history_masked_metrics(retrieval):
    out, res = retrieval
    result = run_snippet(out)
    assert result["recall@10"] == pytest.approx(res["recall@10_masked"], abs=1e-4)
    assert result["ndcg@10"] == pytest.approx(res["ndcg@10_masked"], abs=1e-4)


class ReverseEngine:
    """Stands in for a trained re-ranker: reverses the retriever's top-N (a valid answer, no fallback)."""

    def __init__(self):
        self.threads = set()

    def rerank(self, requests, options=None):
        import threading
        from types import SimpleNamespace

        self.options = options  # what the RecBole model asked for, for tests of the config plumbing
        self.threads.add(threading.current_thread().name)

        return [SimpleNamespace(permutation=list(range(len(r.candidates)))[::-1], fallback=False) for r in requests]


def test_reranked_order_is_what_recbole_scores(retrieval):
    out, res = retrieval
    env = run_snippet(out, engine=ReverseEngine(), namespace=True)
    result, stats = env["result"], env["model"].rerank_stats
    assert stats["users"] > 0 and stats["reordered"] == stats["users"] and stats["fallback"] == 0, stats
    # Same top-10 set, so Recall@10 is unchanged; the reversed order lowers NDCG@10.
    assert result["recall@10"] == pytest.approx(res["recall@10_masked"], abs=1e-4)
    assert result["ndcg@10"] < res["ndcg@10_masked"] - 0.01


def test_rerank_workers_decode_batches_at_once_with_the_same_result(retrieval):
    """rerank_workers: 2 decodes the re-ranker's batches on two threads (reranker.engine.rerank_batches)
    and RecBole scores exactly what one worker gives; a bad count is a clear error."""
    out, _ = retrieval

    class SlowReverse(ReverseEngine):  # a decode long enough for the second worker to start
        def rerank(self, requests, options=None):
            time.sleep(0.02)
            return super().rerank(requests, options)

    one, two = SlowReverse(), SlowReverse()
    r1 = run_snippet(out, engine=one, extra={"rerank_batch_size": 2})
    r2 = run_snippet(out, engine=two, extra={"rerank_batch_size": 2, "rerank_workers": 2})
    assert r2 == r1
    assert len(one.threads) == 1 and len(two.threads) == 2 and all(t.startswith("rerank-decode") for t in two.threads)
    with pytest.raises(ValueError, match="rerank_workers must be an int >= 1, got 0"):
        run_snippet(out, engine=ReverseEngine(), extra={"rerank_workers": 0})
