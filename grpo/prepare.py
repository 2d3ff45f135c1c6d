"""The second phase of an RL step: from a rollout batch to what the update trains on. The update's plan
(mini- and micro-batches with their inputs and loss denominators), the old and reference logprobs (once per
rollout, before any update, in eval mode: the engines sample without dropout), the rewards the advantages are
computed from (DAPO's overlong penalty, verl's KL in the reward), the advantages, and the rollout's logprobs.

Shapes: P prompts, G per prompt, B = P * G rows (a prompt's G consecutive), T completion tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.advantages import compute_advantages
from grpo.groups import Batch
from grpo.losses import kl_penalty, masked_mean
from grpo.parts import Collectives, RLParts
from grpo.plan import MiniBatch, plan_update
from grpo.shaping import kl_reward_penalty, overlong_penalty
from models.logprobs import completion_logprobs, dropout_active, evaluating


@dataclass(frozen=True)
class Prepared:
    """One rollout, ready for the update. Tensors are [B, T] on the CPU (each micro-batch takes its rows)."""
    mini_batches: list[MiniBatch]
    mask: Tensor  # completion tokens times the groups' loss weight (0 for dynamic-sampling fillers)
    advantages: Tensor
    rollout_logprobs: Tensor  # the engine's, of the distribution it sampled from
    old_logprobs: Tensor | None  # None: one optimizer step follows and they are the update's own, detached
    ref_logprobs: Tensor | None  # given when the KL term is in the loss
    rewards: Tensor  # [B], what the advantages were computed from (penalties included)
    metrics: dict  # kl (the KL in the reward), for the step's log


def logprob_pass(model, spec, inputs: dict, *, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """The trainer's logprobs (and entropies) of one micro-batch's completion tokens (grpo.parts.LogprobSpec)."""
    return completion_logprobs(model, inputs, temperature=spec.temperature, chunk_size=spec.chunk_size,
                               packed=spec.packed, vocab_size=spec.vocab_size, with_entropy=with_entropy)


def all_rows(pass_fn: Callable[[dict], Tensor], mini_batches: list[MiniBatch], shape: torch.Size) -> Tensor:
    """Run a no-grad logprob pass (padded inputs -> [b, T_mb]) over every micro-batch and lay the results out as
    one [B, T] CPU tensor. Weight-0 passes (which only pair FSDP's collectives) run but are not kept."""
    out = torch.zeros(shape)
    for mini in mini_batches:
        for micro in mini.micro_batches:
            values = pass_fn(micro.inputs)
            if micro.weight:
                out[micro.rows, : values.shape[1]] = values.float().cpu()
    return out


def padded(rows: list[list[float]], width: int) -> Tensor:
    """B ragged rows -> [B, width] float32, zero-padded on the right."""
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


def needs_old_pass(parts: RLParts) -> bool:
    """Whether the old logprobs need a pass of their own: several optimizer steps per rollout, the KL in the
    reward (it needs them before the update), or dropout (the update's pass would differ from the engines')."""
    spec = parts.spec
    return (not spec.batching.one_update or spec.advantage.kl_in_reward
            or dropout_active(parts.policy.model))


def prepare(parts: RLParts, batch: Batch, dist: Collectives) -> Prepared:
    """The update's inputs for one rollout batch (see the module docstring)."""
    spec, model = parts.spec, parts.policy.model
    to_device = lambda reduce: lambda t: reduce(t.to(dist.device)).cpu()  # noqa: E731
    mini_batches = plan_update(batch.completions, batch.mask, spec.batching, spec.loss.agg, parts.pad_id,
                               all_reduce_sum=to_device(dist.all_reduce_sum),
                               all_reduce_max=to_device(dist.all_reduce_max))
    with torch.no_grad(), evaluating(model):
        old = None
        if needs_old_pass(parts):
            old = all_rows(lambda inputs: logprob_pass(model, spec.logprobs, inputs)[0], mini_batches,
                           batch.mask.shape)
        reference = parts.reference_logprobs
        ref = all_rows(reference, mini_batches, batch.mask.shape) if reference else None
    rewards, metrics, shaping = batch.rewards.clone(), {}, spec.advantage
    if shaping.overlong_cache_len > 0:
        rewards += overlong_penalty(batch.lengths, shaping.max_len, shaping.overlong_cache_len,
                                    shaping.overlong_factor)
    if shaping.kl_in_reward:
        kl_values = kl_penalty(old, ref, shaping.kl_kind)
        rewards += kl_reward_penalty(kl_values, batch.mask, shaping.kl_coef)
        metrics["kl"] = float(masked_mean(kl_values, batch.mask))
    advantages = compute_advantages(shaping.estimator, rewards, batch.token_shaping, batch.mask,
                                    spec.batching.group_size, eps=shaping.eps, weights=batch.loss_weight,
                                    all_reduce_sum=to_device(dist.all_reduce_sum))
    rollout = padded([c.logprobs for c in batch.completions], batch.mask.shape[1])
    kl_in_loss = ref if spec.loss.kl_coef > 0 and not shaping.kl_in_reward else None
    return Prepared(mini_batches, batch.mask, advantages, rollout, old, kl_in_loss, rewards, metrics)

