from candidate_gen.atomic import Interactions
from candidate_gen.split import build_sequences, k_core, leave_one_out, train_sequences


def test_sequences_sorted_by_time_ties_by_file_order():
    inter = Interactions(["u", "u", "u"], ["c", "a", "b"], [3.0, 1.0, 1.0])
    assert build_sequences(inter) == {"u": ["a", "b", "c"]}


def test_leave_one_out_positions():
    seqs = {"u": ["a", "b", "c", "d", "e"]}
    split = leave_one_out(seqs)
    assert [(e.position, seqs["u"][e.position]) for e in split["test"]] == [(4, "e")]
    assert [(e.position, seqs["u"][e.position]) for e in split["valid"]] == [(3, "d")]
    assert [e.position for e in split["train"]] == [1, 2]
    assert train_sequences(seqs) == {"u": ["a", "b", "c"]}


def test_k_core_iterates_until_stable():
    seqs = {"u1": ["a", "b", "c"], "u2": ["a", "b", "c"], "u3": ["a", "d", "c"]}
    # d occurs once -> dropped; then u3 has 2 items -> dropped; a,b,c still have 2 users.
    assert k_core(seqs, user_k=3, item_k=2) == {"u1": ["a", "b", "c"], "u2": ["a", "b", "c"]}


def test_all_ties_keep_file_order_per_user():
    inter = Interactions(["u", "v", "u", "v", "u"], ["c", "z", "a", "y", "b"], [0.0] * 5)
    assert build_sequences(inter) == {"u": ["c", "a", "b"], "v": ["z", "y"]}
