"""The loss of one micro-batch (rl_loss): PPO's clipped surrogate (PPO/GRPO/DAPO at token level, GSPO at sequence
level) or CISPO's clipped importance weights, its aggregations, KL estimators, the entropy bonus and truncated IS.

Every aggregation divides by a denominator passed in from outside, the count of the WHOLE optimizer step (all
micro-batches, all ranks), so gradient accumulation and world size do not change the gradient (torchtitan does
the same; FSDP's own averaging is turned off to match). Shapes: B sequences, T tokens."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.advantages import check_choice, check_shapes
from grpo.config import KL_KINDS, AlgorithmConfig

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: large enough never to bind on sane data, small enough to stay finite
K3_LIMIT = 10.0


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values [B, T] over the tokens where mask [B, T] is 1; 0 (not NaN) when the mask is empty.

    >>> masked_mean(torch.tensor([[1.0, 2.0], [3.0, 9.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    tensor(2.)
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class Aggregation:
    """How per-token values [B, T] become one number: numerator / (count * max_len if per_max_len else count).
    One entry per mode, so loss_denominator and aggregate cannot disagree about what a mode divides by."""
    numerator: Callable[[Tensor, Tensor], Tensor]  # (values * mask [B, T], mask [B, T]) -> 0-dim
    count: Callable[[Tensor], Tensor]  # mask [B, T] -> 0-dim float: tokens or sequences with a token
    per_max_len: bool = False  # Dr. GRPO: the count is also multiplied by the constant max_len


def _sequences(mask: Tensor) -> Tensor:
    return (mask.sum(dim=1) > 0).float().sum()


AGGREGATION: dict[str, Aggregation] = {
    # DAPO (Yu et al. 2025): every token of the step weighs the same.
    "token-mean": Aggregation(numerator=lambda masked, mask: masked.sum(), count=lambda mask: mask.float().sum()),
    # Original GRPO (Shao et al. 2024): each sequence's token mean, then the mean over sequences.
    "seq-mean-token-mean": Aggregation(
        numerator=lambda masked, mask: (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum(), count=_sequences),
    # Dr. GRPO (Liu et al. 2025): the token sum over a constant length, so the length bias goes.
    "seq-mean-token-sum-norm": Aggregation(numerator=lambda masked, mask: masked.sum(), count=_sequences,
                                           per_max_len=True),
}  # keyed by grpo.config.AGGREGATIONS, in its order


def loss_denominator(mask: Tensor, agg: str) -> Tensor:
    """The local count an aggregation divides by: masked tokens ("token-mean") or sequences with a masked token
    ("seq-mean-*"). Summed over micro-batches and ranks, it is aggregate's `denominator` for a whole step.

    >>> loss_denominator(torch.tensor([[1, 1, 0], [0, 0, 0]]), "seq-mean-token-mean")
    tensor(1.)
    """
    check_shapes(2, mask=mask)
    return AGGREGATION[agg].count(mask)


def aggregate(values: Tensor, mask: Tensor, agg: str = "token-mean", *, denominator: Tensor | float | None = None,
              max_len: int | None = None) -> Tensor:
    """Reduce per-token values [B, T] to a scalar as AGGREGATION[agg] says, dividing by `denominator` (None: the
    local count of loss_denominator). A count of 0 is taken as 1, so an all-padding batch gives 0, never NaN."""
    check_shapes(2, values=values, mask=mask)
    entry = AGGREGATION[agg]
    if entry.per_max_len and (max_len is None or max_len < 1):
        raise ValueError(f"agg {agg!r} needs max_len >= 1 (the constant length), got {max_len}")
    mask = mask.to(values.dtype)
    if denominator is None:
        denominator = entry.count(mask)
    denominator = torch.as_tensor(denominator, dtype=values.dtype, device=values.device).clamp(min=1)
    numerator = entry.numerator(values * mask, mask)
    return numerator / (denominator * max_len) if entry.per_max_len else numerator / denominator


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log-ratio in its per-token form (Zheng et al. 2025, "GSPO-token"; verl's
    compute_policy_loss_gspo): [B, T] sg(log s_i) + logprobs - sg(logprobs), log s_i the masked mean over t of
    (logprobs - old). Its exp is s_i in value with d/d logprobs[i, t] = s_i, so with per-sequence advantages and
    "seq-mean-token-mean" the gradient is GSPO's: -A_i s_i (1/|y_i|) sum_t grad logprobs[i, t].

    >>> sequence_log_ratio(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]]), torch.ones(1, 2))
    tensor([[0., 0.]])
    """
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    per_sequence = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / lengths
    return per_sequence.detach() + logprobs - logprobs.detach()


def _ppo_token_loss(logprobs: Tensor, ratio: Tensor, advantages: Tensor, algo: AlgorithmConfig):
    """PPO's clipped surrogate per token: max(-A*rho, -A*clip(rho, 1-clip_low, 1+clip_high)), then dual-clip
    (Ye et al. 2020) caps -A*rho at -A*dual_clip for A < 0. Returns (token loss [B, T], upper, lower, dual: [B, T]
    bool, where each bound binds)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - algo.clip_low, 1.0 + algo.clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(token_loss, dtype=torch.bool)
    if algo.dual_clip is not None:
        cap = -advantages * algo.dual_clip
        dual = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(dual, cap.expand_as(token_loss), token_loss)
    upper = (advantages > 0) & (ratio > 1.0 + algo.clip_high)
    lower = (advantages < 0) & (ratio < 1.0 - algo.clip_low)
    return token_loss, upper, lower, dual


def _cispo_token_loss(logprobs: Tensor, ratio: Tensor, advantages: Tensor, algo: AlgorithmConfig):
    """CISPO (MiniMax-M1, arXiv 2506.13585) per token: -sg(clip(rho, 1 - low, 1 + high)) * A * logp. The weight
    is detached, so the gradient is -w * A * d logp on EVERY token, a capped weight included (PPO's clip
    drops those tokens' gradients). A bound "binds" where it changes the weight, whatever the sign of A."""
    low = None if algo.cispo_clip_low is None else 1.0 - algo.cispo_clip_low
    weight = ratio.detach().clamp(min=low, max=1.0 + algo.cispo_clip_high)
    token_loss = -weight * advantages * logprobs
    upper = ratio > 1.0 + algo.cispo_clip_high
    lower = ratio < low if low is not None else torch.zeros_like(upper)
    return token_loss, upper, lower, torch.zeros_like(upper)


_TOKEN_LOSSES = {"ppo": _ppo_token_loss, "cispo": _cispo_token_loss}  # one per grpo.config.POLICY_LOSSES


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                algo: AlgorithmConfig = AlgorithmConfig(), *, denominator: Tensor | float | None = None,
                max_len: int | None = None, is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy-gradient term (algo.policy_loss per token, times the detached truncated-IS `is_weights`) of
    logprobs and old_logprobs [B, T], advantages [B] or [B, T], mask [B, T], aggregated (algo.agg).

    rho = exp(logprobs - old_logprobs), the log-ratio clamped to +-20. ratio_level "sequence" is GSPO: rho is
    s_i (sequence_log_ratio) on every token of sequence i, so a whole sequence is clipped or not; its clip ranges
    are small (the GSPO paper: 3e-4 / 4e-4), since a mean of log-ratios moves far less than one token's.
    Returns (loss, detached metrics): clip_frac_* (where each bound binds), approx_kl, ratio_mean, ratio_max."""
    check_shapes(2, logprobs=logprobs, old_logprobs=old_logprobs, mask=mask, is_weights=is_weights)
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):  # [B] (one per sequence) or [B, T]
        raise ValueError(f"advantages has shape {tuple(advantages.shape)} but logprobs has shape "
                         f"{tuple(logprobs.shape)}")
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    token_log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = token_log_ratio
    if algo.ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    token_loss, upper, lower, dual = _TOKEN_LOSSES[algo.policy_loss](logprobs, ratio, advantages, algo)
    if is_weights is not None:
        token_loss = token_loss * is_weights.detach()
    loss = aggregate(token_loss, mask, algo.agg, denominator=denominator, max_len=max_len)

    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        metrics = {
            "clip_frac_upper": masked_mean(upper.to(m.dtype), m),
            "clip_frac_lower": masked_mean(lower.to(m.dtype), m),
            "clip_frac_dual": masked_mean(dual.to(m.dtype), m),
            # k3 of the TOKEN log-ratio at either ratio level (a KL estimate, not the clipped quantity).
            "approx_kl": masked_mean(token_log_ratio.exp() - 1.0 - token_log_ratio, m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_max": torch.where(m > 0, ratio, torch.zeros_like(ratio)).max(),
        }
    return loss, metrics


def rl_loss(algo: AlgorithmConfig, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
            denominator: Tensor | float, max_len: int | None = None, rollout_logprobs: Tensor | None = None,
            ref_logprobs: Tensor | None = None, entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The whole loss of one micro-batch: policy_loss (with truncated IS weights of old vs the engine's
    rollout_logprobs when algo.tis_cap is set) + kl_coef * aggregated KL to ref_logprobs (unless algo.kl_in_reward)
    - entropy_coef * aggregated entropy, every term over the same `denominator` (the whole optimizer step's count)
    and max_len (Dr. GRPO's constant length). Tensors are [b, T] (advantages [b] or [b, T]), moved to logprobs'
    device. Returns (loss with gradient, metrics as floats: policy_loss's and those of each term given)."""
    device = logprobs.device
    old_logprobs, advantages, mask = (t.to(device) for t in (old_logprobs, advantages, mask))
    rollout_logprobs = None if rollout_logprobs is None else rollout_logprobs.to(device)
    is_weights = None
    if algo.tis_cap is not None:  # rollout/trainer mismatch (vLLM bf16 vs trainer fp32): truncated IS
        if rollout_logprobs is None:
            raise ValueError("algorithm.tis_cap is set but rollout_logprobs is None: truncated IS needs the engine's")
        is_weights = truncated_is_weights(old_logprobs, rollout_logprobs, cap=algo.tis_cap, level=algo.tis_level,
                                          mask=mask)

    def aggregated(values: Tensor) -> Tensor:  # as the policy loss: the same aggregation and denominator
        return aggregate(values, mask, algo.agg, denominator=denominator, max_len=max_len)

    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, algo, denominator=denominator,
                                max_len=max_len, is_weights=is_weights)
    if ref_logprobs is not None:
        kl_values = kl_penalty(logprobs, ref_logprobs.to(device), algo.kl_kind)
        if algo.kl_coef > 0 and not algo.kl_in_reward:
            loss = loss + algo.kl_coef * aggregated(kl_values)
        metrics["kl"] = masked_mean(kl_values.detach(), mask)
    if entropy is not None:
        if algo.entropy_coef > 0:  # entropy bonus (verl's entropy_coeff): the same aggregation as the policy loss
            loss = loss - algo.entropy_coef * aggregated(entropy)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if rollout_logprobs is not None:  # engine vs trainer on the same weights and tokens
        metrics["logprob_gap"] = masked_mean((old_logprobs - rollout_logprobs).abs(), mask)
    if is_weights is not None:  # how much the correction does: its mean weight and how often the cap binds
        metrics["tis_weight_mean"] = masked_mean(is_weights, mask)
        metrics["tis_clip_frac"] = masked_mean((is_weights >= algo.tis_cap).float(), mask)
    # One device-to-host copy for all metrics (float() of each would be one sync per metric on a GPU).
    values = torch.stack([value.detach().to(torch.float64) for value in metrics.values()]).tolist()
    return loss, dict(zip(metrics, values))


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate [B, T] of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3): with
    d = logprobs - ref_logprobs clamped to +-20, k1 = d, abs = |d|, k2 = d^2 / 2, k3 = exp(-d) + d - 1 clamped to
    <= 10 (unbiased and always >= 0)."""
    check_shapes(2, logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_choice(kind, "kind", KL_KINDS)
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(max=K3_LIMIT)


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float = 2.0, level: str = "token",
                         mask: Tensor | None = None) -> Tensor:
    """Truncated importance weights [B, T] min(exp(old - rollout), cap), no gradient, for the mismatch between the
    trainer's old logprobs and the engine's of the same sampled tokens. level "sequence": exp of the masked sum of
    log-ratios per sequence (needs `mask` [B, T]), broadcast over its tokens."""
    check_shapes(2, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    with torch.no_grad():
        log_ratio = old_logprobs - rollout_logprobs
        if level == "sequence":
            if mask is None:
                raise ValueError("truncated_is_weights(level='sequence') needs mask [B, T]")
            log_ratio = (log_ratio * mask.to(log_ratio.dtype)).sum(dim=1, keepdim=True).expand_as(log_ratio)
        return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).clamp(max=cap)
