"""grpo.update's plan: how a rollout batch is cut into mini-batches (optimizer steps) and micro-batches (passes), with
each mini-batch's denominator; and that every rank agrees on the number of passes."""
import pytest
import torch

from grpo.config import AlgorithmConfig, Config, RolloutConfig, TrainerConfig
from grpo.update import micro_batches, mini_batches, plan_update
from rollout.engine import Completion


def test_mini_batches_are_whole_consecutive_groups():
    assert [rows.tolist() for rows in mini_batches(4, 3, 1)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert [rows.tolist() for rows in mini_batches(4, 2, None)] == [list(range(8))]
    assert [rows.tolist() for rows in mini_batches(4, 2, 4)] == [list(range(8))]
    with pytest.raises(ValueError, match=r"algorithm.ppo_mini_batch_size=3 must be >= 1 and divide the 4 prompts"):
        mini_batches(4, 2, 3)
    with pytest.raises(ValueError, match="ppo_mini_batch_size=0"):
        mini_batches(4, 2, 0)


def test_denominators_per_mini_batch():
    # Rows 0-1 (prompt 0): 3 + 1 tokens; rows 2-3 (prompt 1, a filler group: mask 0); rows 4-5: 2 + 2 tokens.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.float32)
    completions = [Completion(prompt_ids=[1], completion_ids=[2] * int(length), text="", logprobs=[],
                              finish_reason="stop") for length in [3, 1, 1, 1, 2, 2]]

    def denominators(agg, prompts_per_mini_batch):
        cfg = Config(rollout=RolloutConfig(n=2), trainer=TrainerConfig(prompts_per_step=3),
                     algorithm=AlgorithmConfig(agg=agg, ppo_mini_batch_size=prompts_per_mini_batch))
        return [float(mini.denominator) for mini in plan_update(completions, mask, cfg, 1, 0)]

    assert denominators("token-mean", 1) == [4.0, 0.0, 4.0]
    assert denominators("seq-mean-token-mean", 1) == [2.0, 0.0, 2.0]
    assert denominators("seq-mean-token-sum-norm", 3) == [4.0]


def test_micro_batches_by_rows():
    plan = micro_batches(mini_batches(2, 4, 1), [5] * 8, rows_per_micro_batch=3)
    assert [[piece.rows.tolist() for piece in mini] for mini in plan] == [[[0, 1, 2], [3]], [[4, 5, 6], [7]]]
    assert all(piece.weight == 1.0 for mini in plan for piece in mini)


def test_micro_batches_by_tokens_agree_across_ranks():
    lengths = [6, 2, 5, 1, 3, 3, 4, 4]  # two mini-batches of 4 rows: 14 and 14 tokens
    minis = mini_batches(2, 4, 1)
    plan = micro_batches(minis, lengths, rows_per_micro_batch=1, max_tokens=8)
    # 14 tokens in budget 8: 2 micro-batches each; longest first, each to the least loaded (ties: the lower):
    # 6 -> A, 5 -> B, 2 -> B (5 < 6), 1 -> A (6 < 7) | 4 -> A, 4 -> B, 3 -> A (ties), 3 -> B.
    assert [[piece.rows.tolist() for piece in mini] for mini in plan] == [[[0, 3], [1, 2]], [[4, 6], [5, 7]]]
    # Another rank needed 5 passes in the second mini-batch (4 rows here): this rank plans 5 there, one row
    # each and a fifth, empty one, run as a weight-0 pass over the mini-batch's first row (it trains nothing
    # but keeps FSDP's collectives paired).
    calls = []

    def agree_max(counts):
        calls.append(counts.tolist())
        return torch.maximum(counts, torch.tensor([1, 5]))

    plan = micro_batches(minis, lengths, rows_per_micro_batch=1, max_tokens=8, agree_max=agree_max)
    assert calls == [[2, 2], [2, 5]]
    assert [[(piece.rows.tolist(), piece.weight) for piece in mini] for mini in plan] == [
        [([0, 3], 1.0), ([1, 2], 1.0)], [([4], 1.0), ([5], 1.0), ([6], 1.0), ([7], 1.0), ([4], 0.0)]]
    # The budget is the sum of prompt + completion tokens; one row longer than it is an error naming both.
    with pytest.raises(ValueError, match=r"a sequence of 6 tokens .* trainer.max_tokens_per_micro_batch=5; raise"):
        micro_batches(minis, lengths, rows_per_micro_batch=1, max_tokens=5)
