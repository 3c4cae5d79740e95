"""SASRec + generative re-ranker as one RecBole model, evaluated by RecBole's own Trainer.

`SASRecReranked` is a RecBole `SequentialRecommender`. Training delegates to SASRec. In
`full_sort_predict` it scores every item with SASRec, masks the user's history items (on by
default: RecBole does not mask history for sequential models, and an already-bought item on top
would inflate everything), and, when a re-ranker is configured, asks it to re-order SASRec's top-N
and rewrites those N scores so RecBole's metrics see the re-ranked order. With no re-ranker it is
"SASRec alone" under exactly the same masking, so every row of a comparison is like for like.

RecBole config keys (YAML or config_dict):
    sasrec_checkpoint: SASRec weights to load (optional): a run's sasrec/sasrec.safetensors, or the
        directory holding it (`dgr2 retrieve` writes it); never a pickle, so a .pth is an error
    mask_history: true
    rerank_model: model directory (AR or converted diffusion); null = SASRec alone
    rerank_data: re-ranking data directory (dgr2 data build)
    rerank_sequences: the retrieval run's sequences.json (optional): each test user's whole history
        (its last 50 items and its length) goes to the re-ranker, as the data build's test lists
        carry it, instead of the MAX_ITEM_LIST_LENGTH items of RecBole's sequence; a user whose
        RecBole sequence is not the tail of it keeps RecBole's (counted in rerank_stats)
    rerank_top_n: 10
    rerank_batch_size: 8
    rerank_workers: 1 (batches decoded at once, reranker.engine.rerank_batches; 2 on a 2-core CPU)
    rerank_<setting> for each decode setting of reranker.decoding (rerank_decoder, rerank_tau,
        rerank_commit_rule, rerank_hold_eos, rerank_block_size, rerank_max_new_tokens,
        rerank_temperature): unset or null is the model's recorded setting, else the default there

After an evaluation, `rerank_stats` counts the users the re-ranker saw, those whose top-N it
re-ordered, those where its answer did not parse and the order its prompt listed was kept
(fallback: SASRec's, or the pre-ranker's), and those whose history came from RecBole's sequence.
"""
from __future__ import annotations

import numpy as np
import torch

from candidate_gen.recbole_compat import torch_anomaly_mode_kept

with torch_anomaly_mode_kept():  # RecBole's model package turns anomaly detection on at import
    from recbole.model.abstract_recommender import SequentialRecommender
    from recbole.model.sequential_recommender import SASRec
    from recbole.utils import InputType


def _get(config, key, default):
    try:
        value = config[key]
    except (KeyError, TypeError):
        return default
    return default if value is None else value


class SASRecReranked(SequentialRecommender):
    input_type = InputType.POINTWISE

    def __init__(self, config, dataset, engine=None):
        super().__init__(config, dataset)
        self.sasrec = SASRec(config, dataset)
        ckpt = _get(config, "sasrec_checkpoint", None)
        if ckpt:
            from candidate_gen.sasrec import load_state_into

            load_state_into(self.sasrec, ckpt)  # safetensors: nothing is unpickled
        self.mask_history = bool(_get(config, "mask_history", True))
        self.top_n = int(_get(config, "rerank_top_n", 10))
        self.batch_size = int(_get(config, "rerank_batch_size", 8))
        from reranker.decoding import check_workers

        self.workers = check_workers(_get(config, "rerank_workers", 1), "rerank_workers")
        self.item_tokens = [str(t) for t in dataset.field2id_token[self.ITEM_ID]]
        self.user_tokens = [str(t) for t in dataset.field2id_token[self.USER_ID]]
        # Every item the user interacted with in the training split, for history masking beyond
        # the MAX_ITEM_LIST_LENGTH items that the interaction's sequence carries.
        feat = dataset.inter_feat
        uids = feat[self.USER_ID].numpy()
        iids = feat[self.ITEM_ID].numpy()
        lists = feat[self.ITEM_SEQ].numpy() if self.ITEM_SEQ in feat.columns else None
        self.user_items: dict[int, set[int]] = {}
        for r, (u, i) in enumerate(zip(uids, iids)):
            items = self.user_items.setdefault(int(u), set())
            items.add(int(i))
            if lists is not None:
                items.update(int(x) for x in lists[r] if x > 0)
        self.engine = engine
        self.options = None
        self.rerank_stats = {"users": 0, "reordered": 0, "fallback": 0, "recbole_history": 0}
        seq_path = _get(config, "rerank_sequences", None)
        self.sequences = None
        if seq_path:
            import json

            self.sequences = json.loads(open(seq_path, encoding="utf-8").read())
        self.target_ranks: list[tuple[int, int]] | None = None  # a list: full_sort_predict records into it
        model_dir = _get(config, "rerank_model", None)
        if self.engine is None and model_dir:
            from reranker.engine import RerankEngine

            self.engine = RerankEngine.load(model_dir, _get(config, "rerank_data", None))
        if self.engine is not None:
            from reranker.decoding import RECORDED, resolve

            # one config key per decode setting, over what the model records (an engine without a
            # record, such as a stand-in, gets the defaults)
            self.options = resolve({name: _get(config, "rerank_" + name, None) for name in (*RECORDED, "block_size")},
                                   getattr(self.engine, "recorded", None))

    def calculate_loss(self, interaction):
        return self.sasrec.calculate_loss(interaction)

    def predict(self, interaction):
        return self.sasrec.predict(interaction)

    def _history(self, seq_row: np.ndarray, uid: int) -> list[int]:
        return [int(i) for i in seq_row if i > 0]

    def full_sort_predict(self, interaction):
        scores = self.sasrec.full_sort_predict(interaction)
        seqs = interaction[self.ITEM_SEQ].cpu().numpy()
        uids = interaction[self.USER_ID].cpu().numpy()
        if self.mask_history:
            for r, u in enumerate(uids):
                seen = set(self._history(seqs[r], int(u))) | self.user_items.get(int(u), set())
                scores[r, list(seen)] = -torch.inf
            scores[:, 0] = -torch.inf
        if self.engine is not None:
            scores = self._rerank_top(scores, seqs, uids)
        if self.target_ranks is not None:
            self._record_target_ranks(scores, interaction, uids)
        return scores

    def _record_target_ranks(self, scores, interaction, uids) -> None:
        """Append (user, 0-based rank of the test item among all real items) for each row, the rank
        RecBole's full-sort evaluator derives from these scores (it sets item 0, the padding id, to
        -inf), so per-user metrics can be paired across models for bootstrap intervals."""
        target = interaction[self.POS_ITEM_ID].long().view(-1, 1)
        real = scores[:, 1:]
        t = scores.gather(1, target)
        ranks = (real > t).sum(dim=1).cpu().numpy()
        self.target_ranks.extend(zip((int(u) for u in uids), (int(k) for k in ranks)))

    def _whole_history(self, user: str, history: list[str]) -> tuple[list[str], int | None]:
        """(history, its whole length) for the re-ranker: from rerank_sequences where RecBole's sequence
        is the tail of the user's sequence before its test item, else RecBole's (length None)."""
        from candidate_gen.retrieve import HISTORY_KEEP  # the history a candidate list carries

        seq = (self.sequences or {}).get(user)
        if seq is not None and len(seq) > len(history) and seq[:-1][len(seq) - 1 - len(history):] == history:
            return seq[max(0, len(seq) - 1 - HISTORY_KEEP):-1], len(seq) - 1
        self.rerank_stats["recbole_history"] += 1
        return history, None

    @torch.no_grad()
    def _rerank_top(self, scores, seqs, uids):
        from reranker.engine import RerankRequest, rerank_batches

        top_scores, top_idx = torch.topk(scores, self.top_n, dim=1)
        top_idx_np = top_idx.cpu().numpy()
        reqs = []
        for r, u in enumerate(uids):
            history = [self.item_tokens[i] for i in self._history(seqs[r], int(u))]
            history, history_len = self._whole_history(self.user_tokens[int(u)], history)
            cands = [self.item_tokens[i] for i in top_idx_np[r]]
            # rounded as the retrieval stage stores a list's scores (the pre-ranker's features read them)
            scores_r = [round(float(x), 6) for x in top_scores[r].tolist()]
            reqs.append(RerankRequest(history, cands, scores_r, self.user_tokens[int(u)], history_len))
        perms = []
        batches = [reqs[b:b + self.batch_size] for b in range(0, len(reqs), self.batch_size)]
        for results in rerank_batches(self.engine, batches, self.options, self.workers):
            for res in results:
                perms.append(res.permutation)
                self.rerank_stats["users"] += 1
                self.rerank_stats["reordered"] += list(res.permutation) != list(range(len(res.permutation)))
                self.rerank_stats["fallback"] += bool(res.fallback)
        # Rewrite the top-N scores in the re-ranked order, all above every other item's score.
        base = top_scores[:, :1] + 1.0
        for r, perm in enumerate(perms):
            for new_rank, cand in enumerate(perm):
                scores[r, top_idx[r, cand]] = base[r, 0] + (self.top_n - new_rank)
        return scores
