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
