import pytest

from reranker.rl.rewards import rank_reward

N = 10
COPY = list(range(N))


def test_promotion_pays_rank_and_format():
    perm = [3] + [i for i in range(N) if i != 3]
    assert rank_reward(perm, 3, N) == pytest.approx(3 / N + 0.2)


def test_demotion_is_negative_and_unpaid():
    perm = [i for i in range(N) if i != 1] + [1]
    assert rank_reward(perm, 1, N) == pytest.approx((1 - 9) / N)


def test_target_kept_first_gets_format_reward():
    assert rank_reward(COPY, 0, N) == pytest.approx(0.2)


def test_copying_the_input_with_target_not_first_earns_nothing():
    assert rank_reward(COPY, 4, N) == 0.0


def test_invalid_output():
    assert rank_reward(None, 4, N) == -1.0


def test_target_index_checked():
    with pytest.raises(ValueError, match="outside"):
        rank_reward(COPY, 10, N)


def test_a_pre_ranked_prompt_rewards_against_the_order_it_listed():
    """With a pre-ranker the prompt lists the target at incoming_rank: copying that order earns nothing
    unless the target was listed first, and moving it up from there is what is paid."""
    listed = [4, 0, 1, 2, 3, 5, 6, 7, 8, 9]  # the pre-ranker moved candidate 4 (the target) to the top
    assert rank_reward(listed, 4, N, incoming_rank=0) == pytest.approx(0.2)  # kept first: format reward only
    assert rank_reward(COPY, 4, N, incoming_rank=0) == pytest.approx(-4 / N)  # the retriever's order loses it
    assert rank_reward(listed, 4, N) == pytest.approx(4 / N + 0.2)  # what the retriever-order reward would pay
    with pytest.raises(ValueError, match="incoming_rank 10 outside"):
        rank_reward(COPY, 4, N, incoming_rank=10)


def test_rl_prompts_read_the_order_their_prompt_listed():
    from reranker.rl.rollouts import Rollout, RLPrompt, Scorer, load_prompts
    from reranker.text.answer import ParseResult
    from reranker.text.tokenizer import build_tokenizer

    tok = build_tokenizer(["a b c"], vocab_size=300)
    rec = {"prompt_messages": [{"role": "user", "content": "x"}], "candidate_sids": ["a", "b", "c"],
           "target_index": 2, "prompt_order": [2, 0, 1]}
    (p,), skipped = load_prompts(tok, [rec], 64)
    assert skipped == 0 and p.listed == [2, 0, 1] and RLPrompt([1], ["a", "b", "c"], 2).listed == [0, 1, 2]
    scorer = Scorer(tok)
    text = '{"ranking": ["c", "a", "b"]}'
    _, parsed, reward = scorer(p, tok(text, add_special_tokens=False)["input_ids"])
    assert list(parsed.permutation) == [2, 0, 1] and reward == pytest.approx(0.2)  # the listed order, target kept first
    copy = Rollout(0, None, text, ParseResult([2, 0, 1], None), reward, p.listed)
    assert copy.copy and not Rollout(0, None, text, ParseResult([0, 1, 2], None), reward, p.listed).copy
    with pytest.raises(ValueError, match="'prompt_order'"):
        load_prompts(tok, [{**rec, "prompt_order": [0, 0, 1]}], 64)
