"""The RL loop (GRPO, DAPO, Dr. GRPO, process-reward GRPO): one function, read top to bottom.

Variants are config values, not subclasses. Every line of math is a call into grpo/ (advantages, losses,
shaping, filters) or models/ (logprobs); launch/build.py makes the parts this loop receives (grpo/parts.py).
Deliberate choices, each cited where it happens:
- one optimizer step per PPO epoch over the whole rollout batch, so with ppo_epochs=1 the old logprobs ARE
  the current ones detached and no extra forward pass is spent on them (verl/TRL do the same);
- the loss divides by the token (or sequence) count of the WHOLE step over all micro-batches and ranks,
  and FSDP's gradient averaging is off, so micro-batching and world size do not change the gradient;
- a non-finite loss or gradient skips the optimizer step (all ranks agree) and is logged (grpo/update.py).
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch
from torch import Tensor

from grpo.advantages import shaped_advantages
from grpo.config import Config
from grpo.evaluate import evaluation_due
from grpo.groups import collect_groups
from grpo.losses import (aggregate, kl_penalty, loss_denominator, masked_mean, policy_loss,
                         truncated_is_weights)
from grpo.metrics import NoSignalWatch, reduce_metrics, step_metrics
from grpo.parts import Collectives, RLParts
from grpo.shaping import overlong_penalty
from grpo.update import optimizer_step
from models.batching import pad_batch
from models.logprobs import completion_logprobs


@contextmanager
def timed(times: dict, phase: str):
    started = time.perf_counter()
    try:
        yield
    except Exception as error:
        error.add_note(f"phase: {phase}")  # a failed run names its phase (launch.train), e.g. a collective timeout
        raise
    times[phase] = times.get(phase, 0.0) + time.perf_counter() - started


def padded(rows: list[list[float]], width: int) -> Tensor:
    """B ragged rows -> [B, width] float32, zero-padded on the right."""
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


def micro_batch_loss(logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor,
                     rollout_logprobs: Tensor, ref_logprobs: Tensor | None, algo, *,
                     denominator: Tensor, max_len: int) -> tuple[Tensor, dict]:
    """The loss of one micro-batch and its metrics. Tensors are [b, T]; algo: cfg.algorithm; the denominator
    is the whole step's (grpo.losses.loss_denominator summed over micro-batches and ranks)."""
    is_weights = None
    if algo.tis_cap is not None:  # rollout/trainer mismatch (vLLM bf16 vs trainer fp32): truncated IS
        is_weights = truncated_is_weights(old, rollout_logprobs, cap=algo.tis_cap, level=algo.tis_level,
                                          mask=mask)
    loss, metrics = policy_loss(logprobs, old, advantages, mask, clip_low=algo.clip_low,
                                clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.agg,
                                denominator=denominator, max_len=max_len, is_weights=is_weights)
    if ref_logprobs is not None:
        kl_values = kl_penalty(logprobs, ref_logprobs, algo.kl_kind)
        kl_loss = aggregate(kl_values, mask, algo.agg, denominator=denominator, max_len=max_len)
        loss = loss + algo.kl_coef * kl_loss
        metrics["kl"] = masked_mean(kl_values.detach(), mask)
    # Engine vs trainer on the same weights and tokens: the mismatch truncated IS corrects.
    metrics["logprob_gap"] = masked_mean((old - rollout_logprobs).abs(), mask)
    return loss, {key: float(value) for key, value in metrics.items()}


def train_rl(cfg: Config, dist: Collectives, parts: RLParts) -> dict:
    """Run cfg.trainer.steps RL steps from parts.checkpoints.start_step. Returns the last step's metrics."""
    algo, roll, tcfg = cfg.algorithm, cfg.rollout, cfg.trainer
    model, optimizer, scheduler = parts.policy.model, parts.policy.optimizer, parts.policy.scheduler
    log, group_size, max_len = parts.log, roll.n, roll.max_new_tokens
    sampling = dict(max_new_tokens=max_len, temperature=roll.temperature, top_p=roll.top_p, top_k=roll.top_k,
                    stop=roll.stop)
    # The trainer's logprobs use the sampling temperature: the ratio compares like with like.
    logprobs_of = functools.partial(completion_logprobs, temperature=roll.temperature,
                                    chunk_size=cfg.model.logprob_chunk_size)
    watch = NoSignalWatch(tcfg, algo.kl_coef)
    eval_every = tcfg.eval_every if parts.evaluate else 0
    if eval_every and parts.checkpoints.start_step == 0 and tcfg.eval_before:
        log.metrics(0, parts.evaluate(0))  # the curve's starting point
    skips, metrics = 0, {}
    for step in range(parts.checkpoints.start_step, tcfg.steps):
        times: dict[str, float] = {}

        # 1. Rollout and rewards: P prompts x G completions per rank; DAPO keeps only informative groups.
        with timed(times, "rollout_reward"):
            batch = collect_groups(
                parts.engine, parts.sampler, parts.rows, parts.prompt_ids, parts.scorer,
                num_prompts=tcfg.prompts_per_step, group_size=group_size, sampling=sampling,
                seed=cfg.seed * 1_000_003 + step * dist.world_size + dist.rank,
                dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_gen_batches)
            parts.engine.sleep()  # vLLM on GPUs: free the KV cache while the trainer runs (no-op on CPU)
        completions, mask = batch.completions, batch.mask

        # 2. Advantages: DAPO's overlong penalty joins the reward; sentence rewards shape per-token returns
        # (with no sentence reward the shaping is 0 and this is exactly the outcome-level group advantage).
        rewards = batch.rewards.clone()
        if algo.overlong_cache_len > 0:
            rewards += overlong_penalty(batch.lengths, max_len, algo.overlong_cache_len, algo.overlong_factor)
        advantages = shaped_advantages(rewards, batch.token_shaping, mask, group_size, scale=algo.adv_scale,
                                       eps=algo.adv_eps)
        rollout_logprobs = padded([c.logprobs for c in completions], mask.shape[1])

        # 3. Micro-batches and the step's global loss denominator (one all-reduce per step).
        size = tcfg.micro_batch_size
        slices = [slice(s, s + size) for s in range(0, len(completions), size)]
        micro = [pad_batch([c.prompt_ids for c in completions[s]], [c.completion_ids for c in completions[s]],
                           parts.pad_id) for s in slices]
        denominator = dist.all_reduce_sum(loss_denominator(mask, algo.agg).to(dist.device))

        # 4. Old and reference logprobs (no old pass with one update per rollout: old = current, detached).
        with timed(times, "logprob"), torch.no_grad():
            old_logprobs = [logprobs_of(model, mb)[0] for mb in micro] if algo.ppo_epochs > 1 else None
            reference = parts.reference_logprobs
            ref_logprobs = [reference(mb) for mb in micro] if reference else None

        # 5. Update: ppo_epochs optimizer steps over the rollout batch, micro-batched.
        lr, updates = scheduler.get_last_lr()[0], []
        with timed(times, "update"):
            for epoch in range(algo.ppo_epochs):
                loss_sum = 0.0
                for i, (rows, mb) in enumerate(zip(slices, micro)):
                    columns = mb["completion_mask"].shape[1]
                    logprobs, entropy = logprobs_of(model, mb, with_entropy=epoch == 0)
                    old = old_logprobs[i] if old_logprobs else logprobs.detach()
                    loss, record = micro_batch_loss(
                        logprobs, old, advantages[rows, :columns], mask[rows, :columns],
                        rollout_logprobs[rows, :columns], ref_logprobs[i] if ref_logprobs else None, algo,
                        denominator=denominator, max_len=max_len)
                    loss.backward()
                    loss_sum += float(loss.detach())
                    record["tokens"] = float(mask[rows, :columns].sum())
                    if entropy is not None:
                        record["entropy"] = float(masked_mean(entropy.detach(), mask[rows, :columns]))
                    if epoch > 0:  # the gap between engine and trainer is a property of the rollout weights
                        record.pop("logprob_gap")
                    updates.append(record)
                grad_norm, skips = optimizer_step(model, optimizer, scheduler, dist, log, step=step,
                                                  loss=loss_sum, grad_clip=cfg.optim.grad_clip, skips=skips,
                                                  max_skips=tcfg.max_consecutive_skips)

        # 6. Weight sync: the engine generates the next batch with the updated weights.
        with timed(times, "sync"):
            parts.engine.wake()  # weights back first; the sync then overwrites them
            sync_info = parts.sync_weights()

        # 7. Metrics, warnings, samples, held-out scores, checkpoint.
        metrics = step_metrics(batch, rewards, group_size, updates, times, grad_norm=grad_norm, lr=lr,
                               skipped=float(skips > 0), sync_info=sync_info)
        metrics = reduce_metrics(metrics, dist)
        if evaluation_due(step + 1, eval_every, tcfg.steps):
            metrics.update(parts.evaluate(step + 1))
        for warning in watch.update(metrics, step + 1):
            log.warn(warning)
        log.metrics(step + 1, metrics, postfix_keys=("reward_mean", "acc", "format_rate"))
        first_group = zip(completions[:group_size], rewards, batch.correct, batch.rows)
        log.samples(step + 1, [{"prompt": row["prompt"][-1]["content"], "completion": c.text,
                                "reward": float(r), "correct": float(ok), "finish_reason": c.finish_reason}
                               for c, r, ok, row in first_group])
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return metrics
