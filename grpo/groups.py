"""Collect a step's groups: sample prompts, generate G completions each, score them, and (DAPO) keep only
groups whose correctness varies, generating more until the batch is full or the round limit is hit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.filters import keep_groups
from grpo.scoring import score_completions


class PromptSampler:
    """Seeded epoch-wise shuffling of row indices; each rank reads its own stride (whole groups per rank).

    `position` (prompts consumed by this rank) is all the state a resumed run needs.
    """

    def __init__(self, num_rows: int, *, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if num_rows < world_size:
            raise ValueError(f"{num_rows} training rows cannot feed {world_size} ranks")
        self.num_rows, self.seed, self.rank, self.world_size, self.shuffle = num_rows, seed, rank, world_size, shuffle
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        return torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next(self, count: int) -> list[int]:
        per_epoch = self.num_rows // self.world_size
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, per_epoch)
            out.append(self._order(epoch)[offset * self.world_size + self.rank])
            self.position += 1
        return out


@dataclass
class Groups:
    """B = P * G completions of P prompts, grouped (the G completions of a prompt are consecutive)."""
    completions: list  # rollout.engine.Completion
    rows: list[dict]
    rewards: Tensor  # [B]
    correct: Tensor  # [B]
    token_shaping: list[Tensor]  # B rows of [T_b] (zeros without sentence rewards)
    components: dict[str, list[float]]
    loss_weight: Tensor  # [B] 1, or 0 for filler groups that must not train (dynamic sampling)
    rounds: int
    generated_groups: int


def _score(completions, rows, compute_score, decode_prefixes, sentence_coef, correct_threshold):
    scores = score_completions([c.text for c in completions], [c.completion_ids for c in completions], rows,
                               compute_score, decode_prefixes, sentence_coef=sentence_coef,
                               correct_threshold=correct_threshold)
    shaping = [scores.token_shaping[b, : len(c.completion_ids)] if scores.token_shaping is not None
               else torch.zeros(len(c.completion_ids)) for b, c in enumerate(completions)]
    return scores, shaping


def collect_groups(
    engine, sampler: PromptSampler, rows: Sequence[dict], prompt_ids: Sequence[list[int]], *,
    num_prompts: int, group_size: int, sampling: dict, seed: int, compute_score: Callable,
    decode_prefixes: Callable, sentence_coef: float, correct_threshold: float,
    dynamic_sampling: bool = False, max_rounds: int = 1,
) -> Groups:
    """Generate and score until `num_prompts` groups are kept (all of them without dynamic sampling).

    With dynamic sampling, a batch that is still short after `max_rounds` rounds is filled with dropped
    groups whose loss weight is 0, so every rank runs the same number of micro-batches (FSDP needs it).
    """
    kept: list[tuple] = []
    dropped: list[tuple] = []
    rounds = generated = 0
    while len(kept) < num_prompts and rounds < (max_rounds if dynamic_sampling else 1):
        indices = sampler.next(num_prompts)
        completions = engine.generate([prompt_ids[i] for i in indices], n=group_size,
                                      seed=seed + 7919 * rounds, **sampling)
        batch_rows = [rows[i] for i in indices for _ in range(group_size)]
        scores, shaping = _score(completions, batch_rows, compute_score, decode_prefixes, sentence_coef,
                                 correct_threshold)
        keep = keep_groups(scores.correct, group_size) if dynamic_sampling else torch.ones(num_prompts, dtype=torch.bool)
        for p in range(num_prompts):
            span = slice(p * group_size, (p + 1) * group_size)
            group = (completions[span], batch_rows[span], scores.rewards[span], scores.correct[span], shaping[span],
                     {k: v[span] for k, v in scores.components.items()})
            (kept if keep[p] else dropped).append(group)
        rounds += 1
        generated += num_prompts
    weights = [1.0] * len(kept[:num_prompts]) + [0.0] * (num_prompts - min(len(kept), num_prompts))
    chosen = kept[:num_prompts] + dropped[: num_prompts - len(kept[:num_prompts])]
    components: dict[str, list[float]] = {}
    for group in chosen:
        for key, values in group[5].items():
            components.setdefault(key, []).extend(values)
    return Groups(
        completions=[c for g in chosen for c in g[0]], rows=[r for g in chosen for r in g[1]],
        rewards=torch.cat([g[2] for g in chosen]), correct=torch.cat([g[3] for g in chosen]),
        token_shaping=[s for g in chosen for s in g[4]], components=components,
        loss_weight=torch.tensor([w for w in weights for _ in range(group_size)], dtype=torch.float32),
        rounds=rounds, generated_groups=generated,
    )
