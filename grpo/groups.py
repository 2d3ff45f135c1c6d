"""Collect a step's groups: sample prompts, generate G completions each, score them, and (DAPO) keep only
groups whose correctness varies, generating more until the batch is full or the round limit is hit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.filters import keep_groups
from grpo.scoring import Scorer
from rollout.engine import stream_seed


@dataclass
class Group:
    """The G completions of one prompt, scored."""
    completions: list  # G rollout.engine.Completion
    rows: list[dict]  # G times the prompt's row
    rewards: Tensor  # [G]
    correct: Tensor  # [G]
    token_shaping: Tensor  # [G, T_g] sentence shaping (zeros without sentence rewards)
    components: dict[str, list[float]]  # each G values


def _pad_columns(tensors: Sequence[Tensor], width: int) -> Tensor:
    """Stack [n_i, T_i] tensors into [sum n_i, width], zero-padded on the right."""
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


@dataclass
class Batch:
    """B = P * G completions of P prompts (a prompt's G completions consecutive), ready for the update."""
    completions: list
    rows: list[dict]
    rewards: Tensor  # [B] outcome rewards
    correct: Tensor  # [B] 0/1
    lengths: Tensor  # [B] completion lengths in tokens (float32)
    loss_weight: Tensor  # [B] 1, or 0 for filler groups that must not train (dynamic sampling)
    mask: Tensor  # [B, T] completion tokens times loss_weight: what the loss trains on
    token_shaping: Tensor  # [B, T] sentence shaping
    components: dict[str, list[float]]
    rounds: int
    generated_groups: int
    policy_version: int = 0  # optimizer steps of the weights that generated it (staleness: the step minus this)

    @classmethod
    def from_groups(cls, groups: Sequence[Group], weights: Sequence[float], *, rounds: int, generated: int) -> Batch:
        lengths = torch.tensor([len(c.completion_ids) for g in groups for c in g.completions], dtype=torch.float32)
        width = int(lengths.max()) if len(lengths) else 0
        loss_weight = torch.tensor([w for g, w in zip(groups, weights) for _ in g.completions], dtype=torch.float32)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).float() * loss_weight[:, None]
        components: dict[str, list[float]] = {}
        for group in groups:
            for key, values in group.components.items():
                components.setdefault(key, []).extend(values)
        return cls(completions=[c for g in groups for c in g.completions], rows=[r for g in groups for r in g.rows],
                   rewards=torch.cat([g.rewards for g in groups]), correct=torch.cat([g.correct for g in groups]),
                   lengths=lengths, loss_weight=loss_weight, mask=mask,
                   token_shaping=_pad_columns([g.token_shaping for g in groups], width), components=components,
                   rounds=rounds, generated_groups=generated)


def generate_groups(engine, scorer: Scorer, rows: Sequence[dict], prompt_ids: Sequence[list[int]],
                    indices: Sequence[int], *, group_size: int, sampling: dict, seed: int) -> list[Group]:
    """G scored completions for each of the prompts `indices`, one Group per prompt, in order."""
    completions = engine.generate([prompt_ids[i] for i in indices], n=group_size, seed=seed, **sampling)
    batch_rows = [rows[i] for i in indices for _ in range(group_size)]
    scores = scorer.score([c.text for c in completions], [c.completion_ids for c in completions], batch_rows)
    groups = []
    for p in range(len(indices)):
        span = slice(p * group_size, (p + 1) * group_size)
        width = max(len(c.completion_ids) for c in completions[span])
        groups.append(Group(completions[span], batch_rows[span], scores.rewards[span], scores.correct[span],
                            scores.token_shaping[span, :width], {k: v[span] for k, v in scores.components.items()}))
    return groups


def collect_groups(engine, sampler, rows: Sequence[dict], prompt_ids: Sequence[list[int]], scorer: Scorer, *,
                   num_prompts: int, group_size: int, sampling: dict, seed: int, dynamic_sampling: bool = False,
                   max_rounds: int = 1, shares: int = 1, share: int = 0) -> Batch:
    """Share `share` of collect_shares(...): num_prompts groups."""
    return collect_shares(engine, sampler, rows, prompt_ids, scorer, num_prompts=num_prompts, group_size=group_size,
                          sampling=sampling, seed=seed, dynamic_sampling=dynamic_sampling, max_rounds=max_rounds,
                          shares=shares)[share]


def collect_shares(engine, sampler, rows: Sequence[dict], prompt_ids: Sequence[list[int]], scorer: Scorer, *,
                   num_prompts: int, group_size: int, sampling: dict, seed: int, dynamic_sampling: bool = False,
                   max_rounds: int = 1, shares: int = 1) -> list[Batch]:
    """Generate and score until `shares * num_prompts` groups are kept (all of them without dynamic sampling),
    and cut them into `shares` batches of num_prompts groups.

    sampler: data.sampler.PromptSampler (`next(count)` -> row indices of this replica).
    shares:  the trainer ranks one replica generates for: the ranks of a tensor-parallel replica (each runs this
             with the same sampler state and seed, as vLLM needs, gets the same groups and keeps its own share), or
             the trainers a replica on ranks of its own serves (launch/separate.py). 1: this rank alone.
    With dynamic sampling (DAPO) a group is kept only when its correctness is not constant; a batch that is
    still short after `max_rounds` rounds is filled with dropped groups whose loss weight is 0, so every rank
    runs the same number of micro-batches (FSDP needs it). Round 0 generates with `seed` (the trainer's
    rollout.engine.stream_seed(run seed, step, replica)), round r > 0 with stream_seed(seed, r): no round, step
    or replica reuses another's stream.
    """
    wanted = shares * num_prompts
    kept: list[Group] = []
    dropped: list[Group] = []
    rounds = 0
    while len(kept) < wanted and rounds < (max_rounds if dynamic_sampling else 1):
        groups = generate_groups(engine, scorer, rows, prompt_ids, sampler.next(wanted), group_size=group_size,
                                 sampling=sampling, seed=seed if rounds == 0 else stream_seed(seed, rounds))
        informative = keep_groups(torch.cat([g.correct for g in groups]), group_size)
        for group, keep in zip(groups, informative.tolist()):
            (kept if keep or not dynamic_sampling else dropped).append(group)
        rounds += 1
    chosen = kept[:wanted]
    weights = [1.0] * len(chosen) + [0.0] * (wanted - len(chosen))
    chosen += dropped[: wanted - len(chosen)]
    return [Batch.from_groups(chosen[index:index + num_prompts], weights[index:index + num_prompts], rounds=rounds,
                              generated=rounds * num_prompts) for index in range(0, wanted, num_prompts)]
