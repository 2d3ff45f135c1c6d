"""Group-relative advantages (GRPO, Dr. GRPO) for outcome rewards and for token-shaped returns.

Conventions (DESIGN.md): std with Bessel's correction, eps = 1e-6, and a group whose returns are all equal
gets exactly 0 -- zeroed explicitly, because float32 alone gives 0.056 for eight rewards of 0.7.
scale="batch" divides by the std of the whole batch; under torchrun the batch spans every rank, so the loop
sums `batch_moments` over ranks and passes `moments_std` of them in as `batch_std` (the math stays pure).
"""
from __future__ import annotations

import torch
from torch import Tensor

from grpo.checks import check_choice, check_floating, check_groups, check_ndim, check_same_shape

SCALES = ("group", "batch", "none")


def _flat_groups(grouped: Tensor) -> Tensor:
    """[P, G] -> [P, 1] bool: True where every value of the group equals its first one exactly."""
    return (grouped == grouped[:, :1]).all(dim=1, keepdim=True)


def flat_groups(values: Tensor, group_size: int) -> Tensor:
    """Which groups are flat: every value equal to the group's first, exactly (no tolerance: the same test
    that zeroes their advantages, DAPO's filter and the flat_group_frac metric use).

    values: [B] per-completion values of P consecutive groups of G. Returns [P] bool.

    >>> flat_groups(torch.tensor([0.7, 0.7, 0.0, 1.0]), 2)
    tensor([ True, False])
    """
    check_ndim(values, "values", 1)
    check_groups(values.shape[0], group_size)
    return _flat_groups(values.view(-1, group_size)).squeeze(1)


def batch_moments(values: Tensor, weights: Tensor | None = None) -> Tensor:
    """(count, sum, sum of squares) of the values whose weight is non-zero, in float64, to be summed over
    ranks (one all-reduce) and turned into the batch std by moments_std.

    values: [B] float (per-completion returns); weights: [B] 0/1, e.g. grpo.groups.Batch.loss_weight, so that
    filler groups that do not train do not set the scale (None: every value). Returns [3] float64.

    >>> batch_moments(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([1.0, 1.0, 0.0]))
    tensor([2., 1., 1.], dtype=torch.float64)
    """
    check_ndim(values, "values", 1)
    values = values.detach().to(torch.float64)
    keep = torch.ones_like(values) if weights is None else (weights.detach() != 0).to(torch.float64)
    check_same_shape(keep, "weights", values, "values")
    return torch.stack([keep.sum(), (keep * values).sum(), (keep * values.square()).sum()])


def moments_std(moments: Tensor) -> Tensor:
    """Bessel-corrected std from summed (count, sum, sum of squares) [3]: sqrt((S2 - S1^2 / n) / (n - 1)),
    clamped at 0 against rounding; 0 for n <= 1. Returns a 0-dim float64 tensor.

    >>> moments_std(torch.tensor([4.0, 3.0, 3.0], dtype=torch.float64))  # [1, 0, 1, 1]: sqrt(.75 / 3)
    tensor(0.5000, dtype=torch.float64)
    """
    check_ndim(moments, "moments", 1)
    count, total, squares = moments.to(torch.float64).unbind()
    if count <= 1:
        return torch.zeros((), dtype=torch.float64)
    return ((squares - total * total / count) / (count - 1)).clamp(min=0).sqrt()


def _scale(grouped: Tensor, scale: str, batch_std: Tensor | float | None) -> Tensor:
    """Per-group divisor (before eps) for [P, G] returns: group std, batch std (this batch's, or `batch_std`
    given from outside), or 1 (Dr. GRPO)."""
    if scale == "group":
        return grouped.std(dim=1, keepdim=True)  # Bessel-corrected (n - 1)
    if scale == "batch":
        if batch_std is None:
            return grouped.std().expand(grouped.shape[0], 1)
        batch_std = torch.as_tensor(batch_std, dtype=grouped.dtype, device=grouped.device)
        return batch_std.expand(grouped.shape[0], 1)
    return torch.ones_like(grouped[:, :1])


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-6,
                     batch_std: Tensor | float | None = None) -> Tensor:
    """Centre each group's rewards on its mean and, for GRPO, divide by its std.

    rewards: [B] float, the B = P * G rewards of P consecutive groups of G completions.
    scale:   "group" (GRPO), "batch" (group mean, batch std), "none" (Dr. GRPO, mean baseline only).
    batch_std: for scale="batch", the std to divide by (e.g. moments_std of batch_moments summed over
             ranks); None: the std of these B rewards.
    Returns [B] float; a group whose rewards are all equal gets exactly 0.

    >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4, scale="none")
    tensor([ 0.2500, -0.7500,  0.2500,  0.2500])
    >>> group_advantages(torch.full((8,), 0.7), 8)
    tensor([0., 0., 0., 0., 0., 0., 0., 0.])
    """
    check_ndim(rewards, "rewards", 1)
    check_floating(rewards, "rewards")
    check_choice(scale, "scale", SCALES)
    check_groups(rewards.shape[0], group_size)
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = centred / (_scale(grouped, scale, batch_std) + eps) if scale != "none" else centred
    advantages = torch.where(_flat_groups(grouped), torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1)


def completion_returns(rewards: Tensor, token_shaping: Tensor, mask: Tensor) -> Tensor:
    """Each completion's mean return R_i + masked mean of token_shaping[i] (R_i for an all-padding row): the
    value whose group statistics shaped_advantages takes.
    rewards: [B]; token_shaping, mask: [B, T]. Returns [B]."""
    mask = mask.to(token_shaping.dtype)
    return rewards + (token_shaping * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def shaped_advantages(
    rewards: Tensor,
    token_shaping: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    eps: float = 1e-6,
    batch_std: Tensor | float | None = None,
) -> Tensor:
    """Advantages for per-token returns G_i(t) = R_i + token_shaping[i, t] (sentence-level process reward).

    rewards:       [B] float, outcome reward R_i of each completion.
    token_shaping: [B, T] float, e.g. lambda * r_sent(i, t) from grpo.alignment.sentence_shaping.
    mask:          [B, T] 0/1, completion tokens.
    Group statistics are taken over each completion's masked mean of G (an all-padding completion's mean
    is R_i); A_i(t) = (G_i(t) - mu_g) / (sigma_g + eps) on masked tokens, 0 on padding.
    A group whose per-completion means are all equal is left unscaled (G_i(t) - mu_g): dividing by 0 + eps
    would turn shaping of 0.1 into advantages of 1e5. It is exactly 0 when its token returns are equal too.
    With token_shaping == 0 this equals group_advantages broadcast over the mask. batch_std: as in
    group_advantages, the std of the per-completion means (completion_returns) from outside.
    Returns [B, T] float.
    """
    check_ndim(rewards, "rewards", 1)
    check_ndim(token_shaping, "token_shaping", 2)
    check_same_shape(token_shaping, "token_shaping", mask, "mask")
    if token_shaping.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} but token_shaping has {tuple(token_shaping.shape)}")
    check_floating(rewards, "rewards")
    check_choice(scale, "scale", SCALES)
    check_groups(rewards.shape[0], group_size)
    mask = mask.to(token_shaping.dtype)
    returns = rewards[:, None] + token_shaping  # [B, T]
    means = completion_returns(rewards, token_shaping, mask).view(-1, group_size)  # [P, G]
    flat = _flat_groups(means)  # [P, 1]
    # In a flat group take the common value as the baseline (not a float mean of it) so equal returns give 0.
    mu = torch.where(flat, means[:, :1], means.mean(dim=1, keepdim=True))
    divisor = _scale(means, scale, batch_std) + eps if scale != "none" else torch.ones_like(mu)
    divisor = torch.where(flat, torch.ones_like(divisor), divisor)
    token_count = returns.shape[1]
    centred = returns.view(-1, group_size, token_count) - mu[:, :, None]
    advantages = (centred / divisor[:, :, None]).reshape(-1, token_count)
    return advantages * mask


# --- TEMP-MERGE: stand-in for the estimator registry being written beside this branch (take theirs on merge) ---
ESTIMATOR_NAMES = ("grpo", "dr_grpo", "batch_std")


def compute_advantages(estimator, rewards, token_shaping, mask, group_size, *, eps=1e-6, weights=None,
                       all_reduce_sum=lambda tensor: tensor):
    scale = {"grpo": "group", "dr_grpo": "none", "batch_std": "batch"}[estimator]
    batch_std = None
    if scale == "batch":
        moments = batch_moments(completion_returns(rewards, token_shaping, mask), weights)
        batch_std = moments_std(all_reduce_sum(moments))
    return shaped_advantages(rewards, token_shaping, mask, group_size, scale=scale, eps=eps, batch_std=batch_std)
