"""The clipped policy-gradient surrogate (PPO/GRPO/DAPO, token-level; GSPO, sequence-level), its aggregations,
KL estimators and truncated IS.

The denominator of every aggregation may be passed in from outside so that the trainer can divide by the
count of the WHOLE optimizer step (all micro-batches, all ranks): then gradient accumulation and world
size do not change the gradient (torchtitan does the same; FSDP's own averaging is turned off to match).
"""
from __future__ import annotations

import torch
from torch import Tensor

from grpo.checks import check_choice, check_floating, check_ndim, check_same_shape

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3")
IS_LEVELS = ("token", "sequence")
RATIO_LEVELS = ("token", "sequence")
LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: large enough never to bind on sane data, small enough to stay finite
K3_LIMIT = 10.0


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values [B, T] over the tokens where mask [B, T] is 1; 0 (not NaN) when the mask is empty.

    >>> masked_mean(torch.tensor([[1.0, 2.0], [3.0, 9.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    tensor(2.)
    """
    check_same_shape(values, "values", mask, "mask")
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def loss_denominator(mask: Tensor, agg: str) -> Tensor:
    """The local count an aggregation divides by: masked tokens ("token-mean") or sequences with at least
    one masked token (both "seq-mean-*" modes). mask: [B, T] 0/1. Returns a 0-dim float tensor.

    Sum it over micro-batches and ranks and pass it back as `denominator` to aggregate over a whole step.
    """
    check_ndim(mask, "mask", 2)
    check_choice(agg, "agg", AGGREGATIONS)
    if agg == "token-mean":
        return mask.float().sum()
    return (mask.sum(dim=1) > 0).float().sum()


def aggregate(
    values: Tensor, mask: Tensor, agg: str = "token-mean", *, denominator: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar.

    "token-mean":              sum over masked tokens / number of masked tokens (DAPO).
    "seq-mean-token-mean":     mean over sequences of each sequence's masked token mean (original GRPO).
    "seq-mean-token-sum-norm": masked token sum / (number of sequences * max_len) (Dr. GRPO).
    `denominator` replaces the local count (tokens, or sequences) of loss_denominator. A count of 0 is
    taken as 1, so an all-padding batch gives 0, never NaN.
    """
    check_ndim(values, "values", 2)
    check_same_shape(values, "values", mask, "mask")
    check_choice(agg, "agg", AGGREGATIONS)
    mask = mask.to(values.dtype)
    if denominator is None:
        denominator = loss_denominator(mask, agg)
    denominator = torch.as_tensor(denominator, dtype=values.dtype, device=values.device).clamp(min=1)
    masked = values * mask
    if agg == "token-mean":
        return masked.sum() / denominator
    if agg == "seq-mean-token-mean":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / denominator
    if max_len is None or max_len < 1:
        raise ValueError(f"agg 'seq-mean-token-sum-norm' needs max_len >= 1 (the constant length), got {max_len}")
    return masked.sum() / (denominator * max_len)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log-ratio in its per-token form (Zheng et al. 2025, "GSPO-token"; verl's
    compute_policy_loss_gspo computes the same): value log s_i = masked mean over t of (logprobs - old), the
    same on every token of sequence i; gradient that of logprobs[i, t] on token t, scaled by nothing.

    logprobs, old_logprobs, mask: [B, T]. Returns [B, T] float: sg(log s_i) + logprobs - sg(logprobs). Then
    exp of it is s_i in value, and d exp(.)/d logprobs[i, t] = s_i, so with per-sequence advantages and
    "seq-mean-token-mean" aggregation the gradient is GSPO's: -A_i s_i (1/|y_i|) sum_t grad logprobs[i, t]
    (per sequence, before averaging over sequences). An all-padding row has log-ratio 0.

    >>> sequence_log_ratio(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]]), torch.ones(1, 2))
    tensor([[0., 0.]])
    """
    check_ndim(logprobs, "logprobs", 2)
    check_same_shape(old_logprobs, "old_logprobs", logprobs, "logprobs")
    check_same_shape(mask, "mask", logprobs, "logprobs")
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    per_sequence = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths
    return per_sequence.detach() + logprobs - logprobs.detach()


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    denominator: Tensor | float | None = None,
    max_len: int | None = None,
    is_weights: Tensor | None = None,
    ratio_level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate: per token max(-A*rho, -A*clip(rho, 1-clip_low, 1+clip_high)), aggregated.

    logprobs, old_logprobs: [B, T] float, current and behaviour-policy token logprobs.
    advantages:             [B] (one per sequence) or [B, T] float.
    mask:                   [B, T] 0/1.
    rho = exp(logprobs - old_logprobs) with the log-ratio clamped to +-20. clip_high > clip_low is DAPO's
    clip-higher. dual_clip=c (c > 1, Ye et al. 2020) caps the token loss at -A*c where A < 0, so a huge
    ratio on a bad token cannot dominate. is_weights [B, T] (detached) multiply the token loss
    (truncated importance sampling for the rollout/trainer mismatch).
    ratio_level "sequence" is GSPO: rho is the sequence's ratio s_i = exp(masked mean of the log-ratio) on
    every token of sequence i (sequence_log_ratio), so a whole sequence is clipped or not; its clip ranges
    are small (the GSPO paper: 3e-4 / 4e-4), since a mean of log-ratios moves far less than one token's.
    Returns (loss, metrics): detached 0-dim metrics clip_frac_upper / clip_frac_lower / clip_frac_dual
    (fractions of masked tokens), approx_kl (k3 of old vs new), ratio_mean, ratio_max.
    """
    check_ndim(logprobs, "logprobs", 2)
    check_same_shape(old_logprobs, "old_logprobs", logprobs, "logprobs")
    check_same_shape(mask, "mask", logprobs, "logprobs")
    check_floating(logprobs, "logprobs")
    if advantages.ndim == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages has shape {tuple(advantages.shape)} but logprobs has {tuple(logprobs.shape)}")
        advantages = advantages[:, None]
    else:
        check_same_shape(advantages, "advantages", logprobs, "logprobs")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    check_choice(ratio_level, "ratio_level", RATIO_LEVELS)
    token_log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = token_log_ratio
    if ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(token_loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(dual_active, cap.expand_as(token_loss), token_loss)
    if is_weights is not None:
        check_same_shape(is_weights, "is_weights", logprobs, "logprobs")
        token_loss = token_loss * is_weights.detach()
    loss = aggregate(token_loss, mask, agg, denominator=denominator, max_len=max_len)

    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        metrics = {
            "clip_frac_upper": masked_mean(((advantages > 0) & (ratio > 1.0 + clip_high)).to(m.dtype), m),
            "clip_frac_lower": masked_mean(((advantages < 0) & (ratio < 1.0 - clip_low)).to(m.dtype), m),
            "clip_frac_dual": masked_mean(dual_active.to(m.dtype), m),
            # k3 of the TOKEN log-ratio at either ratio level (a KL estimate, not the clipped quantity).
            "approx_kl": masked_mean(token_log_ratio.exp() - 1.0 - token_log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": torch.where(m > 0, ratio, torch.zeros_like(ratio)).max(),
        }
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3).

    logprobs, ref_logprobs: [B, T] float. With d = logprobs - ref_logprobs clamped to +-20:
    k1 = d, abs = |d|, k2 = d^2 / 2, k3 = exp(-d) + d - 1 clamped to <= 10 (unbiased and always >= 0).
    Returns [B, T] float (aggregate it with the same `aggregate` as the policy loss).
    """
    check_ndim(logprobs, "logprobs", 2)
    check_same_shape(ref_logprobs, "ref_logprobs", logprobs, "logprobs")
    check_choice(kind, "kind", KL_KINDS)
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(max=K3_LIMIT)


def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float = 2.0, level: str = "token",
    mask: Tensor | None = None,
) -> Tensor:
    """Truncated importance weights min(exp(old - rollout), cap) for the rollout/trainer mismatch (detached).

    old_logprobs:     [B, T] the trainer's logprobs of the sampled tokens before the update.
    rollout_logprobs: [B, T] the engine's logprobs of the same tokens (what was actually sampled from).
    level "token": one weight per token; "sequence": exp of the masked sum of log-ratios per sequence,
    broadcast over its tokens (needs `mask` [B, T]). Returns [B, T] float, no gradient.
    """
    check_ndim(old_logprobs, "old_logprobs", 2)
    check_same_shape(rollout_logprobs, "rollout_logprobs", old_logprobs, "old_logprobs")
    check_choice(level, "level", IS_LEVELS)
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        log_ratio = old_logprobs - rollout_logprobs
        if level == "sequence":
            if mask is None:
                raise ValueError("truncated_is_weights(level='sequence') needs mask [B, T]")
            check_same_shape(mask, "mask", old_logprobs, "old_logprobs")
            log_ratio = (log_ratio * mask.to(log_ratio.dtype)).sum(dim=1, keepdim=True).expand_as(log_ratio)
        return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).clamp(max=cap)


# --- TEMP-MERGE: stand-in for the loss entry point being written beside this branch (take theirs on merge) ---
from dataclasses import dataclass as _dataclass  # noqa: E402


@_dataclass(frozen=True)
class LossSpec:
    mode: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    ratio_level: str = "token"
    agg: str = "token-mean"
    max_len: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str = "token"


POLICY_LOSSES = ("ppo",)


def rl_loss(spec, logprobs, old_logprobs, advantages, mask, *, denominator, rollout_logprobs=None,
            ref_logprobs=None, entropy=None):
    is_weights = None
    if spec.tis_cap is not None:
        is_weights = truncated_is_weights(old_logprobs, rollout_logprobs, cap=spec.tis_cap, level=spec.tis_level,
                                          mask=mask)
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=spec.clip_low,
                                clip_high=spec.clip_high, dual_clip=spec.dual_clip, agg=spec.agg,
                                denominator=denominator, max_len=spec.max_len, is_weights=is_weights,
                                ratio_level=spec.ratio_level)
    if ref_logprobs is not None and spec.kl_coef > 0:
        kl_values = kl_penalty(logprobs, ref_logprobs, spec.kl_kind)
        loss = loss + spec.kl_coef * aggregate(kl_values, mask, spec.agg, denominator=denominator, max_len=spec.max_len)
        metrics["kl"] = masked_mean(kl_values.detach(), mask)
    if entropy is not None:
        if spec.entropy_coef:
            loss = loss - spec.entropy_coef * aggregate(entropy, mask, spec.agg, denominator=denominator,
                                                        max_len=spec.max_len)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if rollout_logprobs is not None:
        metrics["logprob_gap"] = masked_mean((old_logprobs - rollout_logprobs).abs(), mask)
    if is_weights is not None:
        metrics["tis_weight_mean"] = masked_mean(is_weights, mask)
        metrics["tis_clip_frac"] = masked_mean((is_weights >= spec.tis_cap).float(), mask)
    return loss, metrics
