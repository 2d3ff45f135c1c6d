"""Per-step metrics of the RL loop (TRL-style names), their reduction over ranks, and the warnings that catch
silent no-learning (flat groups, truncation)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo.advantages import flat_groups
from grpo.losses import masked_mean
from grpo.scoring import format_success


def _nanmean(values) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def step_metrics(batch, rewards: Tensor, group_size: int, updates: list[dict], times: dict, *, grad_norm: float,
                 lr: float, skipped: float, sync_info: dict, step: int = 0) -> dict:
    """Everything one step logs. rewards: [B] the advantages' (penalties included); `updates`: one dict per
    micro-batch update, epoch 0 first. Per-update metrics come from the updates that trained on some token (a
    micro-batch of filler groups has no ratio); a rank with none reports NaN, which reduce_metrics skips."""
    lengths = batch.lengths
    truncated = [c.finish_reason == "length" for c in batch.completions]
    tokens = sum(u["tokens"] for u in updates)
    trained = [u for u in updates if u["tokens"] > 0]
    total_time = sum(times.values())
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "acc": float(batch.correct.mean()),
        "flat_group_frac": float(flat_groups(rewards, group_size).float().mean()),
        "kept_group_frac": float(batch.loss_weight.view(-1, group_size)[:, 0].mean()),
        "gen_rounds": float(batch.rounds),
        "staleness": float(step - batch.policy_version),  # 0 on-policy; 1 one step off (rollout.placement=separate)
        "shaped_token_frac": float(masked_mean((batch.token_shaping != 0).float(), batch.mask)),  # sentence reward on?
        "truncation_rate": sum(truncated) / len(truncated),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "grad_norm": grad_norm,
        "lr": lr,
        "skipped": skipped,
        "tokens_per_s": float(lengths.sum()) / max(total_time, 1e-9),
        "trained_tokens": tokens,
        **{f"time_{k}": v for k, v in times.items()},
    }
    for key in ("clip_frac_upper", "clip_frac_lower", "clip_frac_dual", "approx_kl", "ratio_mean", "entropy",
                "logprob_gap", "kl", "distill_reverse_kl", "tis_weight_mean", "tis_clip_frac"):
        if any(key in u for u in updates):
            metrics[key] = _nanmean([u[key] for u in trained if key in u])
    metrics["ratio_max"] = max((u["ratio_max"] for u in trained), default=float("nan"))
    # On the first update of a rollout the ratio is exactly 1 (old = current), a check on every run, except with
    # dropout, whose noise it then reads (docs/conventions.md, "Mini-batches and micro-batches").
    metrics["ratio_first_update"] = trained[0]["ratio_mean"] if trained else float("nan")
    metrics.update({f"reward/{key}": _nanmean(values) for key, values in batch.components.items()})
    if "format" in batch.components:
        metrics["format_rate"] = _nanmean([format_success({"format": v}) for v in batch.components["format"]
                                           if not math.isnan(v)])
    metrics.update({key: float(value) for key, value in sync_info.items()})  # sync/seconds, sync/bytes, ...
    return metrics


def reduce_metrics(metrics: dict, dist) -> dict:
    """Average over the ranks that have a value (not NaN), max for *_max keys. Per-component reward keys (which
    depend on each rank's data sources) stay rank 0's own; the others must match on every rank."""
    if dist.world_size == 1:
        return metrics
    keys = sorted(k for k in metrics if not k.startswith("reward/"))
    mean_keys = [k for k in keys if not k.endswith("_max")]
    max_keys = [k for k in keys if k.endswith("_max")]
    values = torch.tensor([metrics[k] for k in mean_keys], dtype=torch.float64, device=dist.device)
    present = ~values.isnan()
    sums = dist.all_reduce_sum(torch.cat([torch.where(present, values, 0.0), present.to(torch.float64)]))
    means = sums[: len(mean_keys)] / sums[len(mean_keys):]  # 0 / 0 = NaN where no rank has a value
    maxes = torch.tensor([metrics[k] for k in max_keys], dtype=torch.float64, device=dist.device)
    maxes = dist.all_reduce_max(torch.where(maxes.isnan(), float("-inf"), maxes))
    maxes = torch.where(maxes == float("-inf"), float("nan"), maxes)  # no rank had a value
    return metrics | dict(zip(mean_keys, means.tolist())) | dict(zip(max_keys, maxes.tolist()))


class NoSignalWatch:
    """Warns when every group of a step is flat (and no KL term or distillation teacher could still move the policy),
    and when truncation or flat groups (without a teacher, whose signal needs no reward spread) stay above
    trainer.warn_truncation / warn_flat_groups for trainer.warn_after_steps steps."""

    def __init__(self, cfg):
        trainer, self.teacher = cfg.trainer, cfg.algorithm.teacher is not None
        self.thresholds = {"truncation_rate": trainer.warn_truncation}
        if not self.teacher:
            self.thresholds["flat_group_frac"] = trainer.warn_flat_groups
        self.after_steps, self.kl_coef = trainer.warn_after_steps, cfg.algorithm.kl_coef
        self.streaks = dict.fromkeys(self.thresholds, 0)

    def update(self, metrics: dict, step: int) -> list[str]:
        warnings = []
        if metrics["flat_group_frac"] == 1.0 and self.kl_coef == 0 and not self.teacher:
            warnings.append(f"step {step}: zero learning signal -- every group's rewards are identical")
        for key, threshold in self.thresholds.items():
            self.streaks[key] = self.streaks[key] + 1 if metrics[key] > threshold else 0
            if self.streaks[key] >= self.after_steps:
                warnings.append(f"{key} = {metrics[key]:.2f} > {threshold} for {self.streaks[key]} steps: little "
                                f"or no learning signal (raise rollout.max_new_tokens / check the reward)")
        return warnings
