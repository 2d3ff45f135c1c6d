"""How one rollout batch is cut for the update: mini-batches (one optimizer step each: verl's
ppo_mini_batch_size, TRL's steps_per_generation) and, inside each, micro-batches (one forward/backward each),
with the loss denominator of every mini-batch counted over all its micro-batches and all ranks, so that
neither the micro-batch split nor the world size changes an optimizer step's gradient.

Shapes: P prompts, G completions per prompt, B = P * G rows (a prompt's G rows consecutive), M mini-batches.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.checks import check_ndim
from grpo.losses import loss_denominator
from models.batching import micro_batches_by_tokens


def mini_batches(num_prompts: int, group_size: int, prompts_per_mini_batch: int | None) -> list[Tensor]:
    """Row indices of each mini-batch: `prompts_per_mini_batch` whole consecutive groups (None: all of them).

    Returns M = num_prompts / prompts_per_mini_batch index tensors [prompts_per_mini_batch * G] long.

    >>> [rows.tolist() for rows in mini_batches(4, 2, 2)]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    size = num_prompts if prompts_per_mini_batch is None else prompts_per_mini_batch
    if size < 1 or num_prompts % size:
        raise ValueError(f"algorithm.ppo_mini_batch_size={prompts_per_mini_batch} must be >= 1 and divide "
                         f"the {num_prompts} prompts per step")
    rows = size * group_size
    return [torch.arange(start, start + rows) for start in range(0, num_prompts * group_size, rows)]


def mini_batch_denominators(mask: Tensor, minis: Sequence[Tensor], agg: str) -> Tensor:
    """This rank's loss denominator of each mini-batch (grpo.losses.loss_denominator of its rows: tokens, or
    sequences with a token); sum the [M] result over ranks (one all-reduce) for the global ones.

    mask: [B, T] 0/1 (filler groups of dynamic sampling are 0: they add nothing). Returns [M] float32.

    >>> mini_batch_denominators(torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]]), [torch.tensor([0, 1]),
    ...                         torch.tensor([2, 3])], "token-mean")
    tensor([3., 2.])
    """
    check_ndim(mask, "mask", 2)
    return torch.stack([loss_denominator(mask[rows], agg).float() for rows in minis])


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward/backward, and once planned (plan_update) their padded inputs (models.batching.pad_batch:
    prompts left-padded, completions right-padded to this micro-batch's own width T_mb). weight 0: a pass that only
    keeps FSDP's collectives paired across ranks (a rank with fewer micro-batches than another repeats a row and
    trains on nothing)."""
    rows: Tensor  # [b] long, ascending
    weight: float = 1.0
    inputs: dict | None = None

    def take(self, values: Tensor | None) -> Tensor | None:
        """This micro-batch's slice [b, T_mb] of a step-wide [B, T] tensor (None stays None)."""
        if values is None:
            return None
        return values[self.rows, : self.inputs["completion_mask"].shape[1]]


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step: its micro-batches and its loss denominator summed over them and over all ranks
    (grpo.losses.loss_denominator). A denominator of 0 (only dynamic-sampling filler groups, on every rank)
    takes no step."""
    micro_batches: tuple[MicroBatch, ...]
    denominator: Tensor  # 0-dim float


def plan_update(completions: Sequence, mask: Tensor, batching, agg: str, pad_id: int, *,
                all_reduce_sum: Callable[[Tensor], Tensor] = lambda t: t,
                all_reduce_max: Callable[[Tensor], Tensor] = lambda t: t) -> list[MiniBatch]:
    """The update's plan for one rollout: mini-batches of whole groups (one optimizer step each) made of
    micro-batches (one forward/backward each; every rank runs as many, since FSDP's collectives pair up across
    ranks), each micro-batch with its padded inputs, each mini-batch's denominator summed over ranks (one
    all-reduce). completions: the B rollout.engine.Completion of the step; mask: [B, T] 0/1 (0 for fillers);
    batching: grpo.parts.Batching."""
    from models.batching import pad_batch
    minis = mini_batches(batching.prompts_per_step, batching.group_size, batching.prompts_per_mini_batch)
    plan = micro_batches(minis, [len(c.prompt_ids) + len(c.completion_ids) for c in completions],
                         rows_per_micro_batch=batching.micro_batch_size, max_tokens=batching.max_tokens,
                         agree_max=all_reduce_max)
    denominators = all_reduce_sum(mini_batch_denominators(mask, minis, agg))
    return [MiniBatch(tuple(MicroBatch(micro.rows, micro.weight, pad_batch(
        [completions[r].prompt_ids for r in micro.rows.tolist()],
        [completions[r].completion_ids for r in micro.rows.tolist()], pad_id)) for micro in mini), denominator)
        for mini, denominator in zip(plan, denominators)]


def micro_batches(minis: Sequence[Tensor], lengths: Sequence[int], *, rows_per_micro_batch: int,
                  max_tokens: int = 0, agree_max: Callable[[Tensor], Tensor] = lambda counts: counts
                  ) -> list[list[MicroBatch]]:
    """The micro-batches of each mini-batch.

    lengths: [B] prompt + completion tokens of each row. max_tokens 0: consecutive runs of
    `rows_per_micro_batch` rows (the same count on every rank, since every rank has the same P and G).
    max_tokens > 0: as few micro-batches of at most max_tokens tokens as
    models.batching.micro_batches_by_tokens finds, and then every rank takes the largest count any rank
    needs (`agree_max`: the max all-reduce of an [M] tensor; identity for one process), running the extra
    ones as weight-0 passes.
    Raises ValueError naming both numbers when one row alone exceeds max_tokens.
    """
    if max_tokens <= 0:
        return [[MicroBatch(rows[start:start + rows_per_micro_batch])
                 for start in range(0, len(rows), rows_per_micro_batch)] for rows in minis]
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens (prompt + completion) does not fit in "
                         f"trainer.max_tokens_per_micro_batch={max_tokens}; raise it to at least {longest}")
    counts = torch.ones(len(minis), dtype=torch.long)
    while True:  # the planner may need more micro-batches than asked for; ask again until all ranks agree
        plans = [micro_batches_by_tokens([int(lengths[r]) for r in rows], max_tokens, min_count=int(count))
                 for rows, count in zip(minis, counts)]
        agreed = agree_max(torch.tensor([len(plan) for plan in plans], dtype=torch.long))
        if torch.equal(agreed, counts):
            break
        counts = agreed
    return [[MicroBatch(rows[torch.tensor(plan, dtype=torch.long)]) if plan
             else MicroBatch(rows[:1], weight=0.0) for plan in mini_plan]
            for rows, mini_plan in zip(minis, plans)]
