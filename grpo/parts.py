"""What the loops receive, built once by launch/build.py: frozen values for what never changes during a run,
and the three small interfaces of what launch owns (collectives, the run log, checkpoints and stop requests).

The loops import nothing from launch/: these protocols are the whole contract.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.scoring import Scorer


class Collectives(Protocol):
    """This process's place in the run (launch.dist.DistInfo): one process gives identities. The ranks of one
    engine replica (tp_size consecutive ranks, vLLM tensor parallelism) form data-parallel group dp_rank of
    dp_size: they draw the same prompts and seeds, and rank tp_rank of the group trains on its share."""
    rank: int
    world_size: int
    device: torch.device
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int

    def all_reduce_sum(self, tensor: Tensor) -> Tensor: ...
    def all_reduce_max(self, tensor: Tensor) -> Tensor: ...


class Log(Protocol):
    """The run directory's logs (launch.runlog.RunLog); a no-op on ranks other than 0."""

    def metrics(self, step: int, metrics: dict, postfix_keys: tuple[str, ...] = ...) -> None: ...
    def samples(self, step: int, samples: list[dict]) -> None: ...
    def warn(self, message: str) -> None: ...
    def info(self, message: str) -> None: ...


class Checkpoints(Protocol):
    """Owns the run's progress (launch.checkpointing.Checkpointer): where it starts, periodic and final
    checkpoints, and stop requests (Ctrl-C), agreed over ranks."""
    start_step: int

    def end_step(self, done: int) -> bool:
        """Record that step `done` (1-based) is finished; True when the loop must stop now."""

    def finish(self) -> None:
        """Write the final checkpoint, at the last finished step."""


class Sampler(Protocol):
    """This rank's order over the training rows (data.sampler.PromptSampler)."""
    position: int

    def next(self, count: int) -> list[int]: ...


@dataclass(frozen=True)
class Policy:
    """The model being trained (FSDP2-sharded under torchrun), its optimizer and learning-rate schedule."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True)
class SFTParts:
    policy: Policy
    examples: list[tuple[list[int], list[int]]]  # (prompt ids, target ids) per training row
    sampler: Sampler
    pad_id: int
    log: Log
    checkpoints: Checkpoints
    evaluate: Callable[[int], dict] | None = None  # see RLParts.evaluate


@dataclass(frozen=True)
class RLParts:
    policy: Policy
    engine: Any  # rollout.engine.Engine
    sync_weights: Callable[[], dict]  # push the policy's weights into the engine; returns sync metrics
    reference_logprobs: Callable[[dict], Tensor] | None  # padded batch -> [B, T] logprobs of the KL reference
    rows: list[dict]  # training rows
    prompt_ids: list[list[int]]  # their rendered prompts
    sampler: Sampler
    scorer: Scorer
    pad_id: int
    log: Log
    checkpoints: Checkpoints
    # Held-out scores after step s ({"eval/<metric>": mean, ...}, grpo.evaluate.summarize) for trainer.eval_every;
    # None when the run has no held-out rows.
    evaluate: Callable[[int], dict] | None = None
    # The ids the engines can sample (models.logprobs.sampleable_vocab_size): the trainer's logprobs normalise
    # over these only. None: every row of the output projection.
    vocab_size: int | None = None
