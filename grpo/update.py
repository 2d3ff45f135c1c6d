"""From a rollout batch to optimizer steps: prepare plans the update (mini-batches of whole groups, one optimizer
step each, made of micro-batches, one forward/backward each) and computes what it trains on; update trains.
Shapes: P prompts, G per prompt, B = P * G rows (a prompt's G consecutive), T completion tokens."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.advantages import compute_advantages, distill_advantages, kl_reward_penalty, overlong_penalty
from grpo.config import Config
from grpo.groups import Batch
from grpo.losses import kl_penalty, loss_denominator, masked_mean, rl_loss
from models.logprobs import completion_logprobs, dropout_active, evaluating, micro_batches_by_tokens, pad_batch
from models.lora import disabled_adapters


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str = "constant",
              min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at training step `step` (0-based; all of a step's optimizer steps share
    it, as in verl): a linear warmup from 1/(warmup+1) to 1 (so the first step is not wasted at lr 0), then
    constant, linear or cosine decay.

    >>> [round(lr_factor(s, warmup_steps=2, total_steps=6, schedule="linear"), 4) for s in range(6)]
    [0.3333, 0.6667, 1.0, 0.6667, 0.3333, 0.0]
    >>> round(lr_factor(3, warmup_steps=0, total_steps=7, schedule="cosine", min_ratio=0.1), 4)
    0.55
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def mini_batches(num_prompts: int, group_size: int, prompts_per_mini_batch: int | None) -> list[Tensor]:
    """Each mini-batch's rows [prompts_per_mini_batch * G] long: that many whole consecutive groups (None: all)."""
    size = num_prompts if prompts_per_mini_batch is None else prompts_per_mini_batch
    if size < 1 or num_prompts % size:
        raise ValueError(f"algorithm.ppo_mini_batch_size={prompts_per_mini_batch} must be >= 1 and divide "
                         f"the {num_prompts} prompts per step")
    rows = size * group_size
    return [torch.arange(start, start + rows) for start in range(0, num_prompts * group_size, rows)]


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward/backward and their padded inputs (pad_batch, to this micro-batch's own width T_mb).
    weight 0: a pass (of a repeated row) that trains nothing, only keeping FSDP's collectives paired across ranks."""
    rows: Tensor  # [b] long, ascending
    weight: float = 1.0
    inputs: dict | None = None

    def take(self, values: Tensor | None) -> Tensor | None:
        """This micro-batch's slice [b, T_mb] of a step-wide [B, T] tensor (None stays None)."""
        return None if values is None else values[self.rows, : self.inputs["completion_mask"].shape[1]]


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step: its micro-batches and its loss denominator summed over them and over all ranks. A
    denominator of 0 (only dynamic-sampling filler groups, on every rank) takes no step."""
    micro_batches: tuple[MicroBatch, ...]
    denominator: Tensor  # 0-dim float


def micro_batches(minis: Sequence[Tensor], lengths: Sequence[int], *, rows_per_micro_batch: int,
                  max_tokens: int = 0, agree_max: Callable[[Tensor], Tensor] = lambda counts: counts
                  ) -> list[list[MicroBatch]]:
    """The micro-batches of each mini-batch: runs of `rows_per_micro_batch` rows (the same count on every rank),
    or with max_tokens > 0 as few micro-batches of at most max_tokens prompt + completion tokens (lengths [B]) as
    micro_batches_by_tokens finds, every rank then taking the largest count any rank needs (`agree_max`, the max
    all-reduce of an [M] tensor) and running the extra ones as weight-0 passes."""
    if max_tokens <= 0:
        return [[MicroBatch(rows[start:start + rows_per_micro_batch])
                 for start in range(0, len(rows), rows_per_micro_batch)] for rows in minis]
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens (prompt + completion) does not fit in "
                         f"trainer.max_tokens_per_micro_batch={max_tokens}; raise it to at least {longest}")
    counts = torch.ones(len(minis), dtype=torch.long)
    while True:  # the planner may need more micro-batches than asked for; ask again until all ranks agree
        plans = [micro_batches_by_tokens([int(lengths[r]) for r in rows], max_tokens, min_count=int(count))
                 for rows, count in zip(minis, counts)]
        agreed = agree_max(torch.tensor([len(plan) for plan in plans], dtype=torch.long))
        if torch.equal(agreed, counts):
            break
        counts = agreed
    return [[MicroBatch(rows[torch.tensor(plan, dtype=torch.long)]) if plan
             else MicroBatch(rows[:1], weight=0.0) for plan in mini_plan]
            for rows, mini_plan in zip(minis, plans)]


def plan_update(completions: Sequence, mask: Tensor, cfg: Config, world_size: int, pad_id: int, *,
                all_reduce_sum: Callable[[Tensor], Tensor] = lambda t: t,
                all_reduce_max: Callable[[Tensor], Tensor] = lambda t: t) -> list[MiniBatch]:
    """The update's plan: mini-batches of micro-batches with their padded inputs, each with its denominator
    (loss_denominator of its rows of mask [B, T], filler groups 0) summed over ranks in one all-reduce of all M."""
    mini = cfg.algorithm.ppo_mini_batch_size
    minis = mini_batches(cfg.trainer.prompts_per_step, cfg.rollout.n, None if mini is None else mini // world_size)
    plan = micro_batches(minis, [len(c.prompt_ids) + len(c.completion_ids) for c in completions],
                         rows_per_micro_batch=cfg.trainer.micro_batch_size,
                         max_tokens=cfg.trainer.max_tokens_per_micro_batch, agree_max=all_reduce_max)
    denominators = all_reduce_sum(torch.stack([loss_denominator(mask[rows], cfg.algorithm.agg).float()
                                               for rows in minis]))
    return [MiniBatch(tuple(MicroBatch(micro.rows, micro.weight, pad_batch(
        [completions[r].prompt_ids for r in micro.rows.tolist()],
        [completions[r].completion_ids for r in micro.rows.tolist()], pad_id)) for micro in mini), denominator)
        for mini, denominator in zip(plan, denominators)]


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


def logprob_pass(model, cfg: Config, vocab_size: int | None, inputs: dict, *,
                 with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """The trainer's logprobs (and entropies) of one micro-batch's completion tokens, at the sampling
    temperature (the ratio compares like with like) over the `vocab_size` ids the engines can sample."""
    return completion_logprobs(model, inputs, temperature=cfg.rollout.temperature,
                               chunk_size=cfg.model.logprob_chunk_size, packed=cfg.model.packed_logprobs,
                               vocab_size=vocab_size, with_entropy=with_entropy)


def all_logprobs(parts, model, mini_batches: list[MiniBatch], shape: torch.Size, *,
                 adapters_off: bool = False) -> Tensor | None:
    """A no-grad logprob pass of `model` (None: none, and None back) over every micro-batch, laid out as one [B, T]
    CPU tensor; weight-0 passes (which only pair FSDP's collectives) run but are not kept. adapters_off: the KL
    reference, which with LoRA is the policy module itself with its adapters disabled."""
    if model is None:
        return None
    out = torch.zeros(shape)
    off = disabled_adapters(model) if adapters_off and model is parts.policy.model else contextlib.nullcontext()
    with off, evaluating(model):
        for mini in mini_batches:
            for micro in mini.micro_batches:
                values = logprob_pass(model, parts.cfg, parts.vocab_size, micro.inputs)[0]
                if micro.weight:
                    out[micro.rows, : values.shape[1]] = values.float().cpu()
    return out


def prepare(parts, batch: Batch, dist) -> Prepared:
    """What the update trains on: its plan, the old, reference and teacher logprobs (once per rollout, before any
    update, in eval mode: the engines sample without dropout), the rewards with their penalties (DAPO's overlong
    shaping, verl's KL in the reward) and the advantages (with the teacher's signal). parts: grpo.trainer.Parts."""
    cfg, model, algo = parts.cfg, parts.policy.model, parts.cfg.algorithm
    to_device = lambda reduce: lambda t: reduce(t.to(dist.device)).cpu()  # noqa: E731
    mini_batches = plan_update(batch.completions, batch.mask, cfg, dist.world_size, parts.pad_id,
                               all_reduce_sum=to_device(dist.all_reduce_sum),
                               all_reduce_max=to_device(dist.all_reduce_max))
    # The old logprobs need a pass of their own with several optimizer steps per rollout, the KL in the reward or
    # distillation (they need them before the update), or dropout (the update's pass would differ from the engines').
    one_update = algo.ppo_epochs == 1 and algo.ppo_mini_batch_size in (None, cfg.trainer.prompts_per_step)
    own_pass = not one_update or algo.kl_in_reward or parts.teacher is not None or dropout_active(model)
    with torch.no_grad():
        old = all_logprobs(parts, model if own_pass else None, mini_batches, batch.mask.shape)
        ref = all_logprobs(parts, parts.reference, mini_batches, batch.mask.shape, adapters_off=True)
        teacher = all_logprobs(parts, parts.teacher, mini_batches, batch.mask.shape)
    rewards, metrics = batch.rewards.clone(), {}
    if algo.overlong_cache_len > 0:
        rewards += overlong_penalty(batch.lengths, cfg.rollout.max_new_tokens, algo.overlong_cache_len,
                                    algo.overlong_factor)
    if algo.kl_in_reward:
        kl_values = kl_penalty(old, ref, algo.kl_kind)
        rewards += kl_reward_penalty(kl_values, batch.mask, algo.kl_coef)
        metrics["kl"] = float(masked_mean(kl_values, batch.mask))
    advantages = compute_advantages(algo.adv_estimator, rewards, batch.token_shaping, batch.mask, cfg.rollout.n,
                                    eps=algo.adv_eps, weights=batch.loss_weight,
                                    all_reduce_sum=to_device(dist.all_reduce_sum))
    if teacher is not None:
        advantages += distill_advantages(teacher, old, batch.mask, algo.distill_coef)
        metrics["distill_reverse_kl"] = float(masked_mean(old - teacher, batch.mask))
    rollout = torch.zeros(batch.mask.shape)  # the engine's logprobs, zero-padded on the right
    for b, completion in enumerate(batch.completions):
        rollout[b, : len(completion.logprobs)] = torch.as_tensor(completion.logprobs, dtype=torch.float32)
    kl_in_loss = ref if algo.kl_coef > 0 and not algo.kl_in_reward else None
    return Prepared(mini_batches, batch.mask, advantages, rollout, old, kl_in_loss, rewards, metrics)


def optimizer_step(policy, cfg: Config, dist, log, *, step: int, loss: float, skips: int) -> tuple[float, int]:
    """Clip to optim.grad_clip (0: none), then step, or skip when `loss` or the norm is not finite on some rank
    (every rank decides alike), and zero the gradients. Returns (grad norm before clipping, consecutive skips);
    raises after trainer.max_consecutive_skips in a row, before any checkpoint of such weights."""
    norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.optim.grad_clip or float("inf"))
    # Under FSDP2 the norm of the sharded gradients is a DTensor whose full value is the global norm.
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    bad = dist.all_reduce_max(torch.tensor(float(not (math.isfinite(loss) and math.isfinite(grad_norm))),
                                           device=dist.device))
    if bool(bad > 0):
        skips += 1
        log.warn(f"step {step}: non-finite loss ({loss}) or grad norm ({grad_norm}) on some rank; optimizer step "
                 f"skipped ({skips} in a row)")
        if skips >= cfg.trainer.max_consecutive_skips:
            raise RuntimeError(f"{skips} consecutive optimizer steps skipped for non-finite loss/gradients "
                               f"(trainer.max_consecutive_skips={cfg.trainer.max_consecutive_skips}); stopping "
                               f"without writing a checkpoint from these weights")
    else:
        skips = 0
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return grad_norm, skips


@dataclass
class UpdateResult:
    records: list[dict]  # one per micro-batch update that ran (epoch 0 first): loss metrics and "tokens"
    grad_norm: float  # of the last optimizer step
    skips: int  # consecutive skipped optimizer steps after this update
    loss: float  # this rank's share of the mean loss of the optimizer steps (summed over ranks, the loss)


def update(parts, prepared: Prepared, dist, *, step: int, skips: int) -> UpdateResult:
    """Train on one prepared rollout. A mini-batch with nothing to train on any rank (only DAPO filler groups)
    takes no step: AdamW would still move the weights on its momentum."""
    cfg, model = parts.cfg, parts.policy.model
    records, grad_norm, losses = [], 0.0, []
    for epoch in range(cfg.algorithm.ppo_epochs):
        for mini in prepared.mini_batches:
            if mini.denominator == 0:
                continue
            loss_sum = 0.0
            for micro in mini.micro_batches:
                logprobs, entropy = logprob_pass(model, cfg, parts.vocab_size, micro.inputs,
                                                 with_entropy=epoch == 0 or cfg.algorithm.entropy_coef > 0)
                old = micro.take(prepared.old_logprobs) if prepared.old_logprobs is not None else logprobs.detach()
                loss, metrics = rl_loss(
                    cfg.algorithm, logprobs, old, micro.take(prepared.advantages),
                    micro.take(prepared.mask) * micro.weight, denominator=mini.denominator,
                    max_len=cfg.rollout.max_new_tokens, rollout_logprobs=micro.take(prepared.rollout_logprobs),
                    ref_logprobs=micro.take(prepared.ref_logprobs), entropy=entropy)
                loss.backward()
                loss_sum += float(loss.detach())
                record = dict(metrics, tokens=float(micro.take(prepared.mask).sum()) * micro.weight)
                if epoch > 0:  # the engine gap and the entropy describe the rollout: count them once
                    record.pop("logprob_gap", None), record.pop("entropy", None)
                records.append(record | prepared.metrics)
            grad_norm, skips = optimizer_step(parts.policy, cfg, dist, parts.log, step=step, loss=loss_sum, skips=skips)
            losses.append(loss_sum)
    return UpdateResult(records, grad_norm, skips, sum(losses) / max(len(losses), 1))
