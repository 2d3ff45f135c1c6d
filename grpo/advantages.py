"""From a step's rewards to its advantages: the penalties added to rewards (DAPO's overlong shaping, the KL in the
reward), DAPO's group filter, the estimators behind one registry (GRPO, Dr. GRPO, batch std, RLOO, REINFORCE++)
and on-policy distillation's per-token signal.

Conventions: std with Bessel's correction, eps = 1e-6, and a group whose returns are all equal gets exactly 0 --
zeroed explicitly, because float32 alone gives 0.056 for eight rewards of 0.7. Statistics that span the batch are
summed over ranks by an `all_reduce_sum` argument (the identity in one process), so the math stays pure.
Shapes: P prompts, G completions per prompt (group_size), B = P * G sequences, T response tokens."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")


# Argument checks of the math here and in grpo/losses.py: each raises ValueError naming the argument and its shape.

def check_shapes(ndim: int, **tensors: Tensor | None) -> None:
    """The first tensor must have `ndim` dimensions and every later one that is given (not None) its shape."""
    (first, reference), *others = tensors.items()
    if reference.ndim != ndim:
        raise ValueError(f"{first} must have {ndim} dimension(s), got shape {tuple(reference.shape)}")
    for name, tensor in others:
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {first} has shape {tuple(reference.shape)}")


def check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(choices)}")


def check_groups(num: int, group_size: int) -> None:
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (a group needs a baseline), got {group_size}")
    if num % group_size != 0:
        raise ValueError(f"batch of {num} rewards is not divisible by group_size {group_size}")


def flat_groups(values: Tensor, group_size: int) -> Tensor:
    """Which groups are flat, exactly (no tolerance: the test that zeroes their advantages, DAPO's filter and the
    flat_group_frac metric share). values: [B] per-completion values. Returns [P] bool.

    >>> flat_groups(torch.tensor([0.7, 0.7, 0.0, 1.0]), 2)
    tensor([ True, False])
    """
    check_shapes(1, values=values)
    check_groups(values.shape[0], group_size)
    grouped = values.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def keep_groups(metric: Tensor, group_size: int) -> Tensor:
    """DAPO's dynamic-sampling filter (Yu et al. 2025, section 3.2): keep a group only if its metric varies within
    it. metric: [B], correctness by default, not the shaped reward (a length penalty makes an all-correct group
    look informative when it is not). Returns [P] bool."""
    return ~flat_groups(metric, group_size)


def batch_moments(values: Tensor, weights: Tensor | None = None) -> Tensor:
    """(count, sum, sum of squares) [3] float64 of the values [B] whose weight [B] is non-zero (None: all), to be
    summed over ranks and turned into the batch std by moments_std. Filler groups (weight 0) do not set the scale."""
    check_shapes(1, values=values, weights=weights)
    values = values.detach().to(torch.float64)
    keep = torch.ones_like(values) if weights is None else (weights.detach() != 0).to(torch.float64)
    return torch.stack([keep.sum(), (keep * values).sum(), (keep * values.square()).sum()])


def _moments_var(moments: Tensor) -> Tensor:
    """Bessel-corrected variance (S2 - S1^2 / n) / (n - 1) from (count, sum, sum of squares) [3], clamped at 0
    against rounding; 0 for n <= 1. Returns a 0-dim float64 tensor."""
    count, total, squares = moments.to(torch.float64).unbind()
    if count <= 1:
        return torch.zeros((), dtype=torch.float64)
    return ((squares - total * total / count) / (count - 1)).clamp(min=0)


def moments_std(moments: Tensor) -> Tensor:
    """The Bessel-corrected std, sqrt(_moments_var), from (count, sum, sum of squares) summed over ranks.

    >>> moments_std(torch.tensor([4.0, 3.0, 3.0], dtype=torch.float64))  # [1, 0, 1, 1]: sqrt(.75 / 3)
    tensor(0.5000, dtype=torch.float64)
    """
    return _moments_var(moments).sqrt()


def completion_returns(rewards: Tensor, token_shaping: Tensor, mask: Tensor) -> Tensor:
    """Each completion's mean return [B], R_i + masked mean of token_shaping[i] [B, T] (R_i for an all-padding
    row): the value whose group statistics group_advantages takes when returns are shaped."""
    mask = mask.to(token_shaping.dtype)
    return rewards + (token_shaping * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def _check_returns(rewards: Tensor, group_size: int, token_shaping: Tensor | None, mask: Tensor | None) -> None:
    check_shapes(1, rewards=rewards)
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    check_groups(rewards.shape[0], group_size)
    if token_shaping is not None:
        check_shapes(2, mask=mask, token_shaping=token_shaping)
        if token_shaping.shape[0] != rewards.shape[0]:
            raise ValueError(f"rewards has shape {tuple(rewards.shape)} but token_shaping has "
                             f"{tuple(token_shaping.shape)}")


def group_advantages(rewards: Tensor, group_size: int, *, token_shaping: Tensor | None = None,
                     mask: Tensor | None = None, scale: str = "group", eps: float = 1e-6,
                     batch_std: Tensor | float | None = None) -> Tensor:
    """Centre each group's returns on its mean and, for GRPO, divide by its std: (G_i(t) - mu_g) / (sigma_g + eps).

    rewards: [B] float, the outcome rewards R_i of P consecutive groups of G = group_size completions.
    token_shaping, mask: [B, T], both or neither: returns G_i(t) = R_i + token_shaping[i, t] (the sentence rewards
             of grpo.alignment.sentence_shaping), with group statistics over each completion's completion_returns.
    scale:   "group" (GRPO), "batch" (group mean, batch std: `batch_std`, None: these B values' std), "none"
             (Dr. GRPO, mean baseline only).
    Returns [B] float without shaping, [B, T] with it (0 on padding). A group whose (mean) returns are all equal
    is not scaled and its mean is its common value: equal rewards give exactly 0, and shaping of 0.1 is not
    divided by 0 + eps into 1e5.

    >>> group_advantages(torch.full((8,), 0.7), 8)
    tensor([0., 0., 0., 0., 0., 0., 0., 0.])
    """
    _check_returns(rewards, group_size, token_shaping, mask)
    check_choice(scale, "scale", SCALES)
    means, returns = rewards, rewards[:, None]
    if token_shaping is not None:
        means, returns = completion_returns(rewards, token_shaping, mask), rewards[:, None] + token_shaping
    grouped = means.view(-1, group_size)  # [P, G]
    flat = flat_groups(means, group_size)[:, None]  # [P, 1]
    # In a flat group take the common value as the baseline (not a float mean of it) so equal returns give 0.
    mu = torch.where(flat, grouped[:, :1], grouped.mean(dim=1, keepdim=True))
    if scale == "group":
        divisor = grouped.std(dim=1, keepdim=True) + eps  # Bessel-corrected (n - 1)
    elif scale == "batch":
        std = grouped.std() if batch_std is None else torch.as_tensor(batch_std, dtype=grouped.dtype,
                                                                        device=grouped.device)
        divisor = std.expand(grouped.shape[0], 1) + eps
    else:
        divisor = torch.ones_like(mu)
    divisor = torch.where(flat, torch.ones_like(divisor), divisor)
    centred = returns.view(-1, group_size, returns.shape[1]) - mu[:, :, None]
    advantages = (centred / divisor[:, :, None]).reshape(returns.shape)
    return advantages[:, 0] if token_shaping is None else advantages * mask.to(advantages.dtype)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's overlong penalty (Yu et al. 2025, eq. 13) added to each completion's reward, from lengths [B] in
    tokens: 0 up to max_len - cache_len, then a linear ramp -(len - (max_len - cache_len)) / cache_len * factor,
    -factor at or beyond max_len. Returns [B] float32.

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    check_shapes(1, lengths=lengths)
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = lengths.to(torch.float32)
    start = max_len - cache_len
    ramp = -(lengths - start) / cache_len * factor
    penalty = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return torch.where(lengths >= max_len, torch.full_like(ramp, -factor), penalty)


def kl_reward_penalty(kl_values: Tensor, mask: Tensor, coef: float) -> Tensor:
    """The KL penalty in the reward (verl's algorithm.use_kl_in_reward, fixed coefficient): each token's reward
    loses coef * kl_t, and since the advantage is outcome-level (verl's compute_grpo_outcome_advantage sums a
    sequence's token rewards) the completion's reward [B] changes by -coef * sum_t mask[i, t] * kl_values[i, t],
    kl_values [B, T] being grpo.losses.kl_penalty of the old logprobs against the reference's.

    >>> kl = torch.tensor([[0.5, 0.25, 9.0], [0.1, 0.0, 0.0]])
    >>> kl_reward_penalty(kl, torch.tensor([[1, 1, 0], [1, 0, 0]]), 0.1)
    tensor([-0.0750, -0.0100])
    """
    check_shapes(2, kl_values=kl_values, mask=mask)
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    return -coef * (kl_values.detach() * mask.to(kl_values.dtype)).sum(dim=1)


def distill_advantages(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """On-policy distillation's advantage [B, T] (Agarwal et al. 2024; Thinking Machines 2025): on the tokens the
    student sampled, coef * (teacher logprob - student logprob), the negative per-token reverse-KL estimate, 0 on
    padding; no baseline, no sum over later tokens (docs/conventions.md, "On-policy distillation"). Inputs [B, T].

    >>> distill_advantages(torch.tensor([[-0.5, -2.0, -9.0]]), torch.tensor([[-1.0, -1.0, -1.0]]),
    ...                    torch.tensor([[1, 1, 0]]), 2.0)
    tensor([[ 1., -2.,  0.]])
    """
    check_shapes(2, teacher_logprobs=teacher_logprobs, student_logprobs=student_logprobs, mask=mask)
    return (coef * (teacher_logprobs - student_logprobs)).masked_fill(mask == 0, 0.0)


AllReduceSum = Callable[[Tensor], Tensor]
WHITEN_EPS = 1e-8  # REINFORCE++'s whitening: (x - mean) * rsqrt(var + 1e-8), verl's masked_whiten


@dataclass(frozen=True)
class Estimator:
    """A registered estimator; token_returns=False: defined for outcome rewards only (no token_shaping)."""
    fn: Callable[..., Tensor]
    token_returns: bool


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, *, token_returns: bool) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Register `fn(rewards, token_shaping, mask, group_size, *, eps, weights, all_reduce_sum) -> [B, T]` as
    estimator `name` (verl's register_adv_est). Every estimator takes the same arguments, used or not: rewards [B];
    token_shaping [B, T] (zero without sentence rewards); mask [B, T] 0/1; eps, the std's; weights [B] 0/1 or None,
    0 for filler groups, which must not set a batch statistic; all_reduce_sum, called exactly once by an estimator
    with batch-wide statistics and never by the others, so every rank issues the same collectives. Returns
    advantages [B, T], 0 on padding."""
    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = Estimator(fn, token_returns)
        return fn
    return decorator


@register_estimator("grpo", token_returns=True)
def grpo_advantages(rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *, eps: float,
                    weights: Tensor | None, all_reduce_sum: AllReduceSum) -> Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): (G_i(t) - mean_g) / (std_g + eps), per rank (no group spans two)."""
    return group_advantages(rewards, group_size, token_shaping=token_shaping, mask=mask, scale="group", eps=eps)


@register_estimator("dr_grpo", token_returns=True)
def dr_grpo_advantages(rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *, eps: float,
                       weights: Tensor | None, all_reduce_sum: AllReduceSum) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): G_i(t) - mean_g, no std (dividing by
    it up-weights prompts that are nearly always or nearly never solved)."""
    return group_advantages(rewards, group_size, token_shaping=token_shaping, mask=mask, scale="none", eps=eps)


@register_estimator("batch_std", token_returns=True)
def batch_std_advantages(rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *, eps: float,
                         weights: Tensor | None, all_reduce_sum: AllReduceSum) -> Tensor:
    """Group mean, batch std ("Tricks or Traps? A Deep Dive into RL for LLM Reasoning", Liu et al. 2025):
    (G_i(t) - mean_g) / (std_batch + eps), std_batch of the kept completions' mean returns over every rank."""
    moments = batch_moments(completion_returns(rewards, token_shaping, mask), weights)
    batch_std = moments_std(all_reduce_sum(moments).to(moments.device))
    return group_advantages(rewards, group_size, token_shaping=token_shaping, mask=mask, scale="batch", eps=eps,
                            batch_std=batch_std)


@register_estimator("rloo", token_returns=False)
def rloo_advantages(rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *, eps: float,
                    weights: Tensor | None, all_reduce_sum: AllReduceSum) -> Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): the baseline is the mean of the OTHER G - 1 rewards of the
    group, A_i = r_i - (sum_g - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g), broadcast over the mask."""
    leave_one_out = group_advantages(rewards, group_size, scale="none") * (group_size / (group_size - 1))
    return leave_one_out[:, None] * mask.to(leave_one_out.dtype)


@register_estimator("reinforce_pp", token_returns=False)
def reinforce_pp_advantages(rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *, eps: float,
                            weights: Tensor | None, all_reduce_sum: AllReduceSum) -> Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262) as verl's compute_reinforce_plus_plus_outcome_advantage:
    the return R_i on every real token (gamma = 1), whitened over the real tokens of every rank's batch (fillers
    left out), (x - mean) * rsqrt(var + 1e-8), Bessel's variance; a longer completion weighs more, as in verl.
    The float64 sums of float32 rewards are exact, so a batch of equal rewards gets exactly 0."""
    real = mask.to(torch.float64)
    if weights is not None:
        real = real * (weights.detach() != 0).to(torch.float64)[:, None]
    returns = rewards.detach().to(torch.float64)[:, None].expand_as(real)  # gamma = 1: R_i at every token
    kept = returns * real
    moments = all_reduce_sum(torch.stack([real.sum(), kept.sum(), (kept * kept).sum()])).to(real.device)
    mean = moments[1] / moments[0].clamp(min=1)
    whitened = (returns - mean) * torch.rsqrt(_moments_var(moments) + WHITEN_EPS)
    return whitened.to(rewards.dtype) * mask.to(rewards.dtype)


@register_estimator("none", token_returns=False)
def no_advantages(rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *, eps: float,
                  weights: Tensor | None, all_reduce_sum: AllReduceSum) -> Tensor:
    """No task advantage: 0 everywhere, for on-policy distillation alone (the teacher's signal is added after; the
    rewards are still scored and logged)."""
    return torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)


def compute_advantages(estimator: str, rewards: Tensor, token_shaping: Tensor, mask: Tensor, group_size: int, *,
                       eps: float = 1e-6, weights: Tensor | None = None,
                       all_reduce_sum: AllReduceSum = lambda t: t) -> Tensor:
    """The advantages [B, T] of one rollout batch with the registered `estimator`: the one call the loop makes.
    An outcome-only estimator refuses a non-zero token_shaping rather than silently ignoring it.

    >>> compute_advantages("dr_grpo", torch.tensor([1.0, 0.0]), torch.zeros(2, 3), torch.tensor([[1, 1, 0],
    ...                    [1, 1, 1]]), 2)
    tensor([[ 0.5000,  0.5000,  0.0000],
            [-0.5000, -0.5000, -0.5000]])
    """
    check_choice(estimator, "advantage estimator", tuple(ESTIMATORS))
    _check_returns(rewards, group_size, token_shaping, mask)
    check_shapes(1, rewards=rewards, weights=weights)
    entry = ESTIMATORS[estimator]
    if not entry.token_returns and bool((token_shaping != 0).any()):
        shaped = [name for name, other in ESTIMATORS.items() if other.token_returns]
        choices = ", ".join(shaped[:-1]) + f" or {shaped[-1]}" if len(shaped) > 1 else "".join(shaped)
        raise ValueError(f"algorithm.adv_estimator={estimator} is defined for outcome rewards only, but the reward "
                         f"returned sentence rewards (token_shaping is not zero); set reward.sentence_coef=0 or "
                         f"use {choices}")
    return entry.fn(rewards, token_shaping, mask, group_size, eps=eps, weights=weights, all_reduce_sum=all_reduce_sum)
