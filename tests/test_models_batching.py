"""The token-budget micro-batch planner (models.logprobs.micro_batches_by_tokens): hand-worked plans, the
budget error, and properties over random lengths (a partition, within budget, evenly loaded)."""
import random

import pytest

from models.logprobs import micro_batches_by_tokens


def test_hand_worked_plans():
    # total 30, budget 10 -> 3 micro-batches; 6, 6, 6 open them, then each 4 goes to the least loaded.
    assert micro_batches_by_tokens([6, 6, 6, 4, 4, 4], 10) == [[0, 3], [1, 4], [2, 5]]
    # total 20 fits 2 by count, but 7, 7, 6 do not fit in 2 bins of 10: the planner grows to 3.
    assert micro_batches_by_tokens([7, 7, 6], 10) == [[0], [1], [2]]
    # min_count: every rank runs the same number of passes; missing ones are empty (zero-weight) passes.
    assert micro_batches_by_tokens([3, 2], 10, min_count=3) == [[0], [1], []]
    assert micro_batches_by_tokens([3, 2], 10) == [[0, 1]]


def test_a_sequence_over_the_budget_names_both_numbers():
    with pytest.raises(ValueError, match="sequence 2 has 300 tokens, more than the micro-batch token budget "
                                         "max_tokens=256"):
        micro_batches_by_tokens([10, 20, 300], 256)
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got 0"):
        micro_batches_by_tokens([1], 0)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a token count >= 0, got -4"):
        micro_batches_by_tokens([1, -4], 8)


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_partition_within_budget_and_balance(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(8, 256) for _ in range(rng.randint(1, 64))]
    budget = rng.choice([256, 512, 1024, 4096])
    min_count = rng.randint(1, 4)
    plan = micro_batches_by_tokens(lengths, budget, min_count=min_count)
    assert sorted(index for batch in plan for index in batch) == list(range(len(lengths)))
    loads = [sum(lengths[index] for index in batch) for batch in plan]
    assert all(load <= budget for load in loads)
    assert len(plan) >= max(min_count, -(-sum(lengths) // budget))
    assert all(batch == sorted(batch) for batch in plan)
    # Least-loaded placement: no micro-batch exceeds the mean by more than the longest item.
    assert max(loads) <= sum(lengths) / len(plan) + max(lengths)
    assert micro_batches_by_tokens(lengths, budget, min_count=min_count) == plan  # deterministic
