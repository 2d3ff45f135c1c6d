"""Penalties added to the outcome reward before advantages: DAPO's overlong shaping (a soft length penalty in
the last `cache_len` tokens before the limit) and the KL penalty in the reward (verl's use_kl_in_reward)."""
from __future__ import annotations

import torch
from torch import Tensor

from grpo.checks import check_ndim, check_same_shape


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """Penalty added to the reward of each completion (Yu et al. 2025, DAPO, eq. 13).

    lengths: [B] completion lengths in tokens (int or float).
    0 up to max_len - cache_len; then -(len - (max_len - cache_len)) / cache_len * factor, a linear ramp;
    -factor at or beyond max_len. Returns [B] float32.

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    check_ndim(lengths, "lengths", 1)
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = lengths.to(torch.float32)
    start = max_len - cache_len
    ramp = -(lengths - start) / cache_len * factor
    penalty = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return torch.where(lengths >= max_len, torch.full_like(ramp, -factor), penalty)


def kl_reward_penalty(kl_values: Tensor, mask: Tensor, coef: float) -> Tensor:
    """The KL penalty in the reward (verl's algorithm.use_kl_in_reward, ray_trainer.apply_kl_penalty): each
    token's reward loses coef * kl_t, and since a group-relative advantage is outcome-level (verl's
    compute_grpo_outcome_advantage sums the token rewards of a sequence) the completion's reward changes by

        -coef * sum_t mask[i, t] * kl_values[i, t]

    kl_values: [B, T] per-token KL estimates (grpo.losses.kl_penalty of the rollout policy's logprobs, i.e.
    the old logprobs, against the reference's), no gradient; mask: [B, T] 0/1; coef >= 0 (a fixed coefficient:
    verl's kl_ctrl type "fixed"). Returns [B] float, <= 0 for non-negative estimators (k2, k3, abs).

    >>> kl = torch.tensor([[0.5, 0.25, 9.0], [0.1, 0.0, 0.0]])
    >>> kl_reward_penalty(kl, torch.tensor([[1, 1, 0], [1, 0, 0]]), 0.1)
    tensor([-0.0750, -0.0100])
    """
    check_ndim(kl_values, "kl_values", 2)
    check_same_shape(mask, "mask", kl_values, "kl_values")
    if not coef >= 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    return -coef * (kl_values.detach() * mask.to(kl_values.dtype)).sum(dim=1)
