"""The split of a step's sequences over the data-parallel ranks (megacispo.training.balance): equal counts,
every sequence once, each mini-batch kept whole, near the best split's fullest part, nothing moved where
moving would not help, the same split on every call."""

from __future__ import annotations

import itertools
import random

import pytest

from megacispo.training.balance import Balance, balanced_parts, token_spread


def _best_heaviest(lengths: list[int], num_parts: int) -> int:
    """The lightest fullest part of any split of ``lengths`` into equal-count parts (brute force)."""
    room = len(lengths) // num_parts
    best = sum(lengths)
    for order in itertools.permutations(range(len(lengths))):
        parts = [order[p * room:(p + 1) * room] for p in range(num_parts)]
        best = min(best, max(sum(lengths[i] for i in part) for part in parts))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_parts_have_equal_counts_and_are_near_the_best_split(seed):
    rng = random.Random(seed)
    num_parts = rng.choice([2, 3])
    lengths = [int(rng.paretovariate(1.2) * 10) for _ in range(num_parts * rng.choice([2, 3]))]
    parts = balanced_parts(lengths, num_parts)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert {len(part) for part in parts} == {len(lengths) // num_parts}
    heaviest = max(sum(lengths[i] for i in part) for part in parts)
    # LPT under a count limit: within one sequence of the best split.
    assert heaviest <= _best_heaviest(lengths, num_parts) + max(lengths)
    assert balanced_parts(lengths, num_parts) == parts


def test_a_long_tail_is_spread_over_the_ranks():
    """Rank 0 generated all four long responses: afterwards each rank trains one of them."""
    lengths = [[1024, 1030, 990, 1001, 20, 22, 25, 18], [19, 21, 24, 17, 20, 23, 26, 16]]
    balance = Balance.plan(lengths, num_slices=1)
    assert token_spread(lengths) > 1.8
    moved = [[lengths[i // 8][i % 8] for i in rows] for rows in balance.new_rows]
    assert [sum(length > 500 for length in rank) for rank in moved] == [2, 2]
    assert token_spread(moved) < 1.01
    assert [len(rows) for rows in balance.new_rows] == [8, 8]


def test_each_mini_batch_keeps_its_sequences():
    """K = 2: rows 0-3 of every rank form mini-batch 0, rows 4-7 mini-batch 1; each rank's new rows 0-3
    are sequences of mini-batch 0 only, in every layout."""
    rng = random.Random(3)
    lengths = [[rng.randint(1, 500) for _ in range(8)] for _ in range(4)]
    balance = Balance.plan(lengths, num_slices=2)
    for slice_rows in (range(0, 4), range(4, 8)):
        before = {rank * 8 + row for rank in range(4) for row in slice_rows}
        after = {balance.new_rows[rank][row] for rank in range(4) for row in slice_rows}
        assert after == before


def test_a_balanced_step_moves_nothing():
    lengths = [[30] * 6, [30] * 6]
    balance = Balance.plan(lengths, num_slices=3)
    assert balance.new_rows == [list(range(6)), list(range(6, 12))]
    assert balance.destinations(1) == [1] * 6


def test_parts_go_to_the_rank_holding_most_of_them():
    """Rank 1 holds the long sequences: LPT's first part (the longest sequence) goes where it already is."""
    lengths = [[5, 6, 7, 8], [100, 4, 3, 2]]
    balance = Balance.plan(lengths, num_slices=1)
    assert 4 in balance.new_rows[1]
    assert balance.destinations(1)[0] == 1


def test_unequal_row_counts_are_refused():
    with pytest.raises(ValueError, match="the same rows"):
        Balance.plan([[1, 2], [3]], num_slices=1)
