"""What the loops receive, built once by launch/build.py: frozen specs of what never changes during a run (read
from the config there, so no config object reaches the loops or the math), the parts they run, and the small
interfaces of what launch owns (collectives, the run log, checkpoints and stop requests).

The loops import nothing from launch/: these types are the whole contract.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.losses import LossSpec
from grpo.scoring import Scorer
from rollout.engine import Engine


class StepFailed(RuntimeError):
    """A failure inside a loop, with the phase it happened in (rollout_reward, logprob, update, sync, held-out
    evaluation, checkpoint) and the step; the error itself is the cause. launch.train names the rank."""

    def __init__(self, phase: str, step: int | None, error: BaseException):
        super().__init__(f"{phase} failed at step {step}: {type(error).__name__}: {error}")
        self.phase, self.step = phase, step


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
class Sampling:
    """What the engine samples with (rollout.engine.Engine.generate's keyword arguments)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()

    def kwargs(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, stop=list(self.stop))


@dataclass(frozen=True)
class LogprobSpec:
    """How the trainer's logprob passes run (models.logprobs.completion_logprobs): the sampling temperature (the
    ratio compares like with like), chunking, packing, and the ids the engines can sample (None: every row)."""
    temperature: float = 1.0
    chunk_size: int = 1024
    packed: bool = False
    vocab_size: int | None = None


@dataclass(frozen=True)
class Batching:
    """How a step's rollout is cut for the update (grpo.plan): prompts_per_mini_batch is per rank (None: the whole
    batch, one optimizer step per epoch), micro-batches by rows or, when max_tokens > 0, by tokens."""
    prompts_per_step: int
    group_size: int
    prompts_per_mini_batch: int | None = None
    ppo_epochs: int = 1
    micro_batch_size: int = 8
    max_tokens: int = 0

    @property
    def one_update(self) -> bool:
        """One optimizer step per rollout: the old logprobs can be the update's own, detached."""
        return self.ppo_epochs == 1 and self.prompts_per_mini_batch in (None, self.prompts_per_step)


@dataclass(frozen=True)
class AdvantageSpec:
    """From a step's rewards to its advantages: DAPO's overlong penalty (cache_len 0: off; max_len is
    rollout.max_new_tokens), the KL in the reward (verl's use_kl_in_reward), and the estimator."""
    estimator: str = "grpo"
    eps: float = 1e-6
    max_len: int = 1
    overlong_cache_len: int = 0
    overlong_factor: float = 1.0
    kl_in_reward: bool = False
    kl_coef: float = 0.0
    kl_kind: str = "k3"


@dataclass(frozen=True)
class Watch:
    """The no-signal warnings (grpo.metrics.NoSignalWatch): thresholds and the streak length."""
    truncation: float = 0.5
    flat_groups: float = 0.9
    after_steps: int = 3


@dataclass(frozen=True)
class Evaluation:
    """When the loops score the held-out rows: before the first step (when `before`), every `every` steps (0:
    only before and after) and after the last one."""
    every: int = 0
    before: bool = True


@dataclass(frozen=True)
class RLSpec:
    """Everything the RL loop reads that never changes during a run."""
    steps: int
    seed: int
    sampling: Sampling
    batching: Batching
    logprobs: LogprobSpec
    advantage: AdvantageSpec
    loss: LossSpec
    dynamic_sampling: bool = False
    max_gen_batches: int = 1
    grad_clip: float = 1.0
    max_consecutive_skips: int = 3
    evaluation: Evaluation = field(default_factory=Evaluation)
    watch: Watch = field(default_factory=Watch)


@dataclass(frozen=True)
class SFTSpec:
    """Everything the SFT loop reads."""
    steps: int
    batch_size: int
    micro_batch_size: int
    chunk_size: int = 1024
    grad_clip: float = 1.0
    max_consecutive_skips: int = 3
    evaluation: Evaluation = field(default_factory=Evaluation)


# Held-out evaluation after step s: grpo.evaluate.evaluate's result (count, per-prompt values, means with 95%
# intervals, records); None when the run has no held-out rows.
Evaluate = Callable[[int], dict]


@dataclass(frozen=True, kw_only=True)
class SFTParts:
    spec: SFTSpec
    policy: Policy
    examples: Sequence[tuple[list[int], list[int]]]  # (prompt ids, target ids) per training row
    sampler: Sampler
    pad_id: int
    log: Log
    checkpoints: Checkpoints
    evaluate: Evaluate | None = None


@dataclass(frozen=True, kw_only=True)
class RLParts:
    spec: RLSpec
    policy: Policy
    engine: Engine
    sync_weights: Callable[[], dict]  # push the policy's weights into the engine; returns sync metrics
    reference_logprobs: Callable[[dict], Tensor] | None  # padded batch -> [B, T] logprobs of the KL reference
    rows: Sequence[dict]  # training rows
    prompt_ids: Sequence[list[int]]  # their rendered prompts
    sampler: Sampler
    scorer: Scorer
    pad_id: int
    log: Log
    checkpoints: Checkpoints
    evaluate: Evaluate | None = None
