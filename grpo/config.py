"""The algorithm's settings (`algorithm.*` of a recipe): one dataclass, a docstring per field, the valid choices
and numeric ranges beside the field that takes them, and the two helpers every section of the run's schema
(launch/schema.py) declares its fields with. The choice lists are the math's own (grpo/advantages.py,
grpo/losses.py), so a value the schema accepts is one the math knows. launch/build.py turns these settings into
the frozen specs the loops receive (grpo/parts.py); the math never sees this object.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from grpo.advantages import ESTIMATOR_NAMES
from grpo.losses import AGGREGATIONS, IS_LEVELS, KL_KINDS, POLICY_LOSSES, RATIO_LEVELS


def choice(default: str, choices: tuple[str, ...]):
    """A string field whose value must be one of `choices` (launch/config.py checks it when a recipe is read)."""
    return field(default=default, metadata={"choices": choices})


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric field: finite, and within [low, high] (an open end excludes the bound;
    None is unbounded on that side).

    >>> str(Range(0, 1, high_open=True)), str(Range(low=1)), str(Range(0, low_open=True)), str(Range())
    ('in [0, 1)', '>= 1', '> 0', 'a finite number')
    >>> Range(0, 1).contains(1.0), Range(0, 1, high_open=True).contains(1.0), Range().contains(math.nan)
    (True, False, False)
    """
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "a finite number"


def bounded(default, low: float | None = None, high: float | None = None, *, low_open: bool = False,
            high_open: bool = False):
    """A numeric field (int, float, an optional one, or a list of numbers: each element) whose value must lie in
    Range(low, high, ...); launch/config.py checks it when a recipe is read. None, where the type allows it,
    is always accepted (it means "off")."""
    metadata = {"range": Range(low, high, low_open, high_open)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = choice("grpo", ESTIMATOR_NAMES)
    """The advantage estimator (grpo.advantages): grpo (group mean and std), dr_grpo (group mean only), batch_std
    (group mean, the std of the whole batch over all ranks), rloo (leave-one-out mean), reinforce_pp (REINFORCE++:
    the batch-normalised return). Sentence rewards shape the returns of grpo, dr_grpo and batch_std only."""
    policy_loss: str = choice("ppo", POLICY_LOSSES)
    """ppo (the clipped surrogate, with clip-higher and dual-clip; GSPO with ratio_level=sequence) or cispo
    (MiniMax-M1: the clipped importance weight, detached, times the advantage times the log-probability)."""
    adv_eps: float = bounded(1e-6, 0)
    """eps in (r - mean) / (std + eps)."""
    clip_low: float = bounded(0.2, 0, 1, high_open=True)
    """epsilon_low of the clipped surrogate."""
    clip_high: float = bounded(0.2, 0)
    """epsilon_high (DAPO's clip-higher uses 0.28)."""
    dual_clip: float | None = bounded(None, 1, low_open=True)
    """c > 1 caps the token loss at -A*c where A < 0; null is off."""
    agg: str = choice("token-mean", AGGREGATIONS)
    """token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO)."""
    kl_coef: float = bounded(0.0, 0)
    """Weight of the KL penalty to the frozen reference model; 0 means no reference model at all."""
    kl_kind: str = choice("k3", KL_KINDS)
    """k1, abs, k2 or k3."""
    kl_in_reward: bool = False
    """verl's use_kl_in_reward: kl_coef * KL (kl_kind, of the rollout policy against the reference) leaves the
    reward instead of joining the loss: each completion's reward loses kl_coef * its summed token KL before
    advantages (grpo.shaping.kl_reward_penalty). Needs kl_coef > 0."""
    ppo_epochs: int = bounded(1, 1)
    """Passes over each rollout batch. With one optimizer step per rollout (1 epoch, 1 mini-batch) the old
    logprobs are the current ones detached; otherwise one extra pass computes them once, before the first
    update."""
    ppo_mini_batch_size: int | None = bounded(None, 1)
    """Prompts per optimizer step over ALL ranks, as in verl (trainer.prompts_per_step is per rank): each rank's
    share is this / world size, which must divide trainer.prompts_per_step. Each mini-batch is one optimizer
    step, each epoch visits them in order. null: the whole batch (one step per epoch)."""
    cispo_clip_low: float | None = bounded(None, 0, 1)
    """policy_loss=cispo: lower bound of the importance weight, clip(rho, 1 - low, ...); null is none (MiniMax-M1).
    verl's CISPO uses PPO's clip_low here."""
    cispo_clip_high: float = bounded(4.0, 0)
    """policy_loss=cispo: the weight is at most 1 + this (4: TRL's recommended cap of 5)."""
    ratio_level: str = choice("token", RATIO_LEVELS)
    """token (PPO/GRPO/DAPO) or sequence (GSPO: one ratio per sequence, exp of the mean token log-ratio; needs
    GSPO's small clip ranges, e.g. clip_low 3e-4, clip_high 4e-4, and agg seq-mean-token-mean, its mean over
    sequences: start-up refuses any other agg)."""
    entropy_coef: float = bounded(0.0, 0)
    """Entropy bonus: the loss subtracts entropy_coef * the aggregated token entropy (same agg and global
    denominator as the policy loss); 0 is off."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose correctness is constant and generate more until the batch is full."""
    max_gen_batches: int = bounded(3, 1)
    """Generation rounds per step allowed for dynamic sampling before training on what is there."""
    overlong_cache_len: int = bounded(0, 0)
    """DAPO overlong shaping: penalty ramp length in tokens before max_new_tokens; 0 is off."""
    overlong_factor: float = bounded(1.0, 0)
    """Maximum overlong penalty."""
    max_staleness: int = bounded(0, 0, 1)
    """rollout.placement=separate: how many optimizer steps older than the trainer the weights that generated a
    batch may be. 0: synchronous (the engines wait for every update); 1: one step off-policy (step n+1's batch is
    generated during step n's update), the behaviour policy corrected by truncated IS (tis_cap)."""
    tis_cap: float | None = bounded(None, 0, low_open=True)
    """Truncated importance sampling cap C for the rollout/trainer mismatch; null is off."""
    tis_level: str = choice("token", IS_LEVELS)
    """token or sequence."""
