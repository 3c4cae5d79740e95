"""The SID-copy diagnostic: per-level teacher-forced accuracy, perfect for a model that copies."""

import torch

from reranker.eval.sid_copy import sid_copy_accuracy, token_levels
from tests.reranker.data.test_copy_warmup import SIDS


class Oracle(torch.nn.Module):
    """Predicts the next token of a fixed sequence: whatever the batch holds at t+1."""

    def __init__(self, wrong_level=None, levels=None):
        super().__init__()
        self.wrong_level, self.levels, self.vocab = wrong_level, levels or {}, 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1)
        if self.wrong_level:
            bad = torch.tensor([[self.levels.get(int(t)) == self.wrong_level for t in row] for row in nxt])
            nxt = torch.where(bad, torch.zeros_like(nxt), nxt)
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float()
        return type("Out", (), {"logits": logits})()


def test_sid_copy_accuracy_by_level():
    from reranker.data.copy_warmup import copy_example
    from reranker.text.tokenizer import build_tokenizer
    from tests.reranker.text.test_tokenizer import corpus

    tok = build_tokenizer(corpus() + [r["assistant"] for r in (copy_example(SIDS, 0),)], vocab_size=600)
    levels = token_levels(tok)
    assert set(levels.values()) >= {"a", "b", "c", "d"}
    recs = [copy_example(SIDS, k) for k in range(4)]
    perfect = Oracle()
    perfect.vocab = len(tok)
    res = sid_copy_accuracy(perfect, tok, recs)
    assert res["examples"] == 4 and all(v == 1.0 for v in res["by_level"].values()), res
    assert res["tokens"]["a"] == 40
    # the one SID each reasoning writes ("<sid> (#k) first") is scored apart from the answer's ten
    assert {k: v["tokens"] for k, v in res["reasoning_by_level"].items()} == {"a": 4, "b": 4, "c": 4, "d": 4}
    assert all(v["accuracy"] == 1.0 for v in res["reasoning_by_level"].values())
    bad_b = Oracle("b", levels)
    bad_b.vocab = len(tok)
    res = sid_copy_accuracy(bad_b, tok, recs)
    assert res["by_level"]["b"] == 0.0 and res["by_level"]["a"] == 1.0
    assert res["reasoning_by_level"]["b"]["accuracy"] == 0.0 and res["reasoning_by_level"]["a"]["accuracy"] == 1.0


class SwapB(Oracle):
    """Copies everything except the second SID level, where it writes another candidate's code."""

    def __init__(self, swap):
        super().__init__()
        self.swap = swap

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1)
        nxt = torch.tensor([[self.swap.get(int(t), int(t)) for t in row] for row in nxt])
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, self.vocab).float()})()


def test_sid_copy_splits_by_prefix_and_classifies_errors():
    from reranker.data.copy_warmup import copy_example
    from reranker.text.tokenizer import build_tokenizer
    from tests.reranker.text.test_tokenizer import corpus

    tok = build_tokenizer(corpus() + [copy_example(SIDS, 0)["assistant"]], vocab_size=600)
    recs = [copy_example(SIDS, k) for k in range(2)]
    perfect = Oracle()
    perfect.vocab = len(tok)
    res = sid_copy_accuracy(perfect, tok, recs)
    # SIDS: distinct first levels, so every later level has a unique prefix; the first level never does.
    assert set(res["by_prefix"]["a"]) == {"shared"} and set(res["by_prefix"]["b"]) == {"unique"}
    assert res["errors"] == {"other_candidate": 0, "context": 0, "invented": 0}
    b0, b1 = tok.convert_tokens_to_ids(["<b_0>", "<b_1>"])
    swapped = SwapB({b0: b1})
    swapped.vocab = len(tok)
    res = sid_copy_accuracy(swapped, tok, recs)
    n_b0 = 2 * sum(1 for s in SIDS if "<b_0>" in s)  # answer SIDs with <b_0>, two examples
    assert res["errors"] == {"other_candidate": n_b0, "context": 0, "invented": 0}, res["errors"]
    assert res["by_prefix"]["b"]["unique"]["accuracy"] == 1 - n_b0 / res["tokens"]["b"]


def test_greedy_copy_validity_parses_against_the_reference_sids(monkeypatch):
    from types import SimpleNamespace

    from reranker.data.copy_warmup import copy_example
    import reranker.diffusion.ar_decoder as ar
    from reranker.eval.sid_copy import greedy_copy_validity, reference_ranking
    from reranker.text.tokenizer import IM_END, build_tokenizer
    from tests.reranker.text.test_tokenizer import corpus

    tok = build_tokenizer(corpus() + [copy_example(SIDS, 0)["assistant"]], vocab_size=600)
    recs = [copy_example(SIDS, 2), copy_example(SIDS, 3), copy_example(SIDS, 4)]
    assert reference_ranking(recs[0]) == [SIDS[2]] + SIDS[:2] + SIDS[3:]
    answers = [recs[0]["assistant"],  # the reference itself
               "<think>\nx\n</think>\n" + recs[1]["assistant"].split("</think>\n")[1].replace(SIDS[3], SIDS[5]),
               # SIDS[5] twice: a duplicate
               '<think>\nx\n</think>\n{"ranking": ' + str(SIDS[::-1]).replace("'", '"') + "}"]  # valid, reordered
    encoded = [tok(a + IM_END, add_special_tokens=False)["input_ids"] for a in answers]
    seen = []

    def fake_decode(model, prompts, max_new_tokens, eos, pad):
        seen.append(len(prompts))
        out, encoded[:] = encoded[:len(prompts)], encoded[len(prompts):]
        return SimpleNamespace(tokens=out)

    monkeypatch.setattr(ar, "ar_decode", fake_decode)
    res = greedy_copy_validity(torch.nn.Identity(), tok, recs, batch_size=2)
    assert seen == [2, 1]
    assert res == {"examples": 3, "valid_rate": 2 / 3, "exact_rate": 1 / 3, "failures": {"duplicate": 1}}
