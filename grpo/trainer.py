"""The RL loop (GRPO, DAPO, Dr. GRPO, GSPO, process-reward GRPO): one function, read top to bottom.

Variants are config values, not subclasses. Every line of math is a call into grpo/ (advantages, losses,
shaping, filters, plan) or models/ (logprobs); launch/build.py makes the parts this loop receives
(grpo/parts.py). Deliberate choices, each cited where it happens:
- a rollout batch is cut into mini-batches, one optimizer step each (verl's ppo_mini_batch_size), visited
  ppo_epochs times; with a single optimizer step per rollout the old logprobs ARE the current ones detached
  and no extra forward pass is spent on them (verl/TRL do the same), otherwise they are computed once, before
  the first update;
- each mini-batch's loss divides by its token (or sequence) count over all its micro-batches and all ranks,
  and FSDP's gradient averaging is off, so micro-batching and world size do not change the gradient; the one
  batch-wide statistic (the std of adv_scale=batch) is all-reduced too;
- the learning rate is the step's for all of its optimizer steps; the schedule advances once per step;
- a non-finite loss or gradient skips the optimizer step (all ranks agree) and is logged (grpo/update.py).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor

from grpo.advantages import batch_moments, completion_returns, moments_std, shaped_advantages
from grpo.config import Config
from grpo.evaluate import evaluation_due
from grpo.groups import collect_groups
from grpo.losses import aggregate, kl_penalty, masked_mean, policy_loss, truncated_is_weights
from grpo.metrics import NoSignalWatch, reduce_metrics, step_metrics
from grpo.parts import Collectives, RLParts
from grpo.plan import mini_batch_denominators, mini_batches, micro_batches
from grpo.shaping import kl_reward_penalty, overlong_penalty
from grpo.update import optimizer_step
from models.batching import pad_batch
from models.logprobs import completion_logprobs, dropout_active, evaluating
from rollout.engine import stream_seed


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


def all_rows(pass_fn: Callable[[dict], Tensor], micro: list, shape: torch.Size) -> Tensor:
    """Run a no-grad logprob pass (padded batch -> [b, T_mb]) over every micro-batch and lay the results out
    as one [B, T] CPU tensor, so later passes can take any rows. Weight-0 passes (which only pair FSDP's
    collectives) run but are not kept."""
    out = torch.zeros(shape)
    for mini in micro:
        for piece, batch in mini:
            values = pass_fn(batch)
            if piece.weight:
                out[piece.rows, : values.shape[1]] = values.float().cpu()
    return out


def micro_batch_loss(logprobs: Tensor, entropy: Tensor | None, old: Tensor, advantages: Tensor, mask: Tensor,
                     rollout_logprobs: Tensor, ref_logprobs: Tensor | None, algo, *,
                     denominator: Tensor, max_len: int) -> tuple[Tensor, dict]:
    """The loss of one micro-batch and its metrics. Tensors are [b, T]; algo: cfg.algorithm; the denominator
    is the mini-batch's (grpo.plan.mini_batch_denominators summed over ranks). ref_logprobs: given when the
    KL term is in the loss."""
    device = logprobs.device
    old, advantages, mask, rollout_logprobs = (t.to(device) for t in (old, advantages, mask,
                                                                      rollout_logprobs))
    is_weights = None
    if algo.tis_cap is not None:  # rollout/trainer mismatch (vLLM bf16 vs trainer fp32): truncated IS
        is_weights = truncated_is_weights(old, rollout_logprobs, cap=algo.tis_cap, level=algo.tis_level,
                                          mask=mask)
    loss, metrics = policy_loss(logprobs, old, advantages, mask, clip_low=algo.clip_low,
                                clip_high=algo.clip_high, dual_clip=algo.dual_clip, agg=algo.agg,
                                denominator=denominator, max_len=max_len, is_weights=is_weights,
                                ratio_level=algo.ratio_level)
    if ref_logprobs is not None:
        kl_values = kl_penalty(logprobs, ref_logprobs.to(device), algo.kl_kind)
        kl_loss = aggregate(kl_values, mask, algo.agg, denominator=denominator, max_len=max_len)
        loss = loss + algo.kl_coef * kl_loss
        metrics["kl"] = masked_mean(kl_values.detach(), mask)
    if entropy is not None:
        if algo.entropy_coef:  # entropy bonus (verl's entropy_coeff): the same aggregation as the policy loss
            loss = loss - algo.entropy_coef * aggregate(entropy, mask, algo.agg, denominator=denominator,
                                                        max_len=max_len)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    # Engine vs trainer on the same weights and tokens: the mismatch truncated IS corrects.
    metrics["logprob_gap"] = masked_mean((old - rollout_logprobs).abs(), mask)
    if is_weights is not None:  # how much the correction does: its mean weight and how often the cap binds
        metrics["tis_weight_mean"] = masked_mean(is_weights, mask)
        metrics["tis_clip_frac"] = masked_mean((is_weights >= algo.tis_cap).float(), mask)
    return loss, {key: float(value) for key, value in metrics.items()}


def train_rl(cfg: Config, dist: Collectives, parts: RLParts) -> dict:
    """Run cfg.trainer.steps RL steps from parts.checkpoints.start_step. Returns the last step's metrics."""
    algo, roll, tcfg = cfg.algorithm, cfg.rollout, cfg.trainer
    model, optimizer, scheduler = parts.policy.model, parts.policy.optimizer, parts.policy.scheduler
    log, group_size, max_len = parts.log, roll.n, roll.max_new_tokens
    sampling = dict(max_new_tokens=max_len, temperature=roll.temperature, top_p=roll.top_p, top_k=roll.top_k,
                    stop=roll.stop)
    # The trainer's logprobs use the sampling temperature: the ratio compares like with like,
    # and normalise over the ids the engines can sample (a padded vocabulary's extra rows never are).
    logprobs_of = functools.partial(completion_logprobs, temperature=roll.temperature,
                                    chunk_size=cfg.model.logprob_chunk_size, packed=cfg.model.packed_logprobs,
                                    vocab_size=parts.vocab_size)
    prompts_per_mini_batch = (algo.ppo_mini_batch_size // dist.world_size if algo.ppo_mini_batch_size is not None
                              else None)  # verl's meaning: prompts over all ranks
    # With one optimizer step per rollout the old logprobs are the current ones detached, unless dropout would
    # make the update's pass differ from the eval-mode pass the engines sample like.
    one_update = (algo.ppo_epochs == 1 and prompts_per_mini_batch in (None, tcfg.prompts_per_step)
                  and not dropout_active(model))
    agree_max = lambda counts: dist.all_reduce_max(counts.to(dist.device)).cpu()  # noqa: E731
    watch = NoSignalWatch(tcfg, algo.kl_coef)
    eval_every = tcfg.eval_every if parts.evaluate else 0
    if eval_every and parts.checkpoints.start_step == 0 and tcfg.eval_before:
        log.metrics(0, parts.evaluate(0))  # the curve's starting point
    skips, metrics = 0, {}
    for step in range(parts.checkpoints.start_step, tcfg.steps):
        times: dict[str, float] = {}

        # 1. Rollout and rewards: P prompts x G completions per rank; DAPO keeps only informative groups. The
        # ranks of one engine replica (tensor parallelism) submit the same requests and keep their own shares.
        with timed(times, "rollout_reward"):
            batch = collect_groups(
                parts.engine, parts.sampler, parts.rows, parts.prompt_ids, parts.scorer,
                num_prompts=tcfg.prompts_per_step, group_size=group_size, sampling=sampling,
                seed=stream_seed(cfg.seed, step, dist.dp_rank), dynamic_sampling=algo.dynamic_sampling,
                max_rounds=algo.max_gen_batches, shares=dist.tp_size, share=dist.tp_rank)
            parts.engine.sleep()  # vLLM on GPUs: free weights and KV cache while the trainer runs (no-op on CPU)
        completions, mask = batch.completions, batch.mask

        # 2. The plan: mini-batches of whole groups (one optimizer step each) made of micro-batches (one
        # forward/backward each; every rank runs as many, since FSDP's collectives pair up across ranks), and
        # each mini-batch's loss denominator summed over its micro-batches and the ranks (one all-reduce).
        minis = mini_batches(tcfg.prompts_per_step, group_size, prompts_per_mini_batch)
        plan = micro_batches(minis, [len(c.prompt_ids) + len(c.completion_ids) for c in completions],
                             rows_per_micro_batch=tcfg.micro_batch_size,
                             max_tokens=tcfg.max_tokens_per_micro_batch, agree_max=agree_max)
        micro = [[(piece, pad_batch([completions[r].prompt_ids for r in piece.rows.tolist()],
                                    [completions[r].completion_ids for r in piece.rows.tolist()],
                                    parts.pad_id)) for piece in mini] for mini in plan]
        denominators = dist.all_reduce_sum(mini_batch_denominators(mask, minis, algo.agg).to(dist.device))

        # 3. Old and reference logprobs, once per rollout, before any update, in eval mode (no dropout: the
        # engines sampled without it). No old pass when a single optimizer step follows (old = current,
        # detached), unless the KL in the reward needs them now.
        with timed(times, "logprob"), torch.no_grad(), evaluating(model):
            old_logprobs = None
            if not one_update or algo.kl_in_reward:
                old_logprobs = all_rows(lambda b: logprobs_of(model, b)[0], micro, mask.shape)
            reference = parts.reference_logprobs
            ref_logprobs = all_rows(reference, micro, mask.shape) if reference else None

        # 4. Advantages: DAPO's overlong penalty and (verl's use_kl_in_reward) the summed token KL join the
        # reward; sentence rewards shape per-token returns (with none: the outcome-level group advantage).
        # The batch std of adv_scale=batch is over every rank's batch (moments summed in one all-reduce).
        rewards, extra = batch.rewards.clone(), {}
        if algo.overlong_cache_len > 0:
            rewards += overlong_penalty(batch.lengths, max_len, algo.overlong_cache_len, algo.overlong_factor)
        if algo.kl_in_reward:
            kl_values = kl_penalty(old_logprobs, ref_logprobs, algo.kl_kind)
            rewards += kl_reward_penalty(kl_values, mask, algo.kl_coef)
            extra["kl"] = float(masked_mean(kl_values, mask))
        batch_std = None
        if algo.adv_scale == "batch":
            moments = batch_moments(completion_returns(rewards, batch.token_shaping, mask), batch.loss_weight)
            batch_std = moments_std(dist.all_reduce_sum(moments.to(dist.device)).cpu())
        advantages = shaped_advantages(rewards, batch.token_shaping, mask, group_size, scale=algo.adv_scale,
                                       eps=algo.adv_eps, batch_std=batch_std)
        rollout_logprobs = padded([c.logprobs for c in completions], mask.shape[1])
        kl_in_loss = ref_logprobs if algo.kl_coef > 0 and not algo.kl_in_reward else None

        # 5. Update: ppo_epochs passes over the mini-batches, one optimizer step per mini-batch. A mini-batch
        # with nothing to train on any rank (only DAPO filler groups) takes no step: AdamW would still move.
        lr, updates, grad_norm = scheduler.get_last_lr()[0], [], 0.0
        with timed(times, "update"):
            for epoch in range(algo.ppo_epochs):
                for mini, denominator in zip(micro, denominators):
                    if denominator == 0:
                        continue
                    loss_sum = 0.0
                    for piece, mb in mini:
                        rows, columns = piece.rows, mb["completion_mask"].shape[1]
                        part = lambda t: None if t is None else t[rows, :columns]  # noqa: E731
                        logprobs, entropy = logprobs_of(model, mb,
                                                        with_entropy=epoch == 0 or algo.entropy_coef > 0)
                        old = part(old_logprobs) if old_logprobs is not None else logprobs.detach()
                        loss, record = micro_batch_loss(
                            logprobs, entropy, old, part(advantages), part(mask) * piece.weight,
                            part(rollout_logprobs), part(kl_in_loss), algo, denominator=denominator,
                            max_len=max_len)
                        loss.backward()
                        loss_sum += float(loss.detach())
                        record["tokens"] = float(part(mask).sum()) * piece.weight
                        if epoch > 0:  # the engine gap and the entropy describe the rollout: count them once
                            record.pop("logprob_gap"), record.pop("entropy", None)
                        updates.append(record | extra)
                    grad_norm, skips = optimizer_step(model, optimizer, dist, log, step=step, loss=loss_sum,
                                                      grad_clip=cfg.optim.grad_clip, skips=skips,
                                                      max_skips=tcfg.max_consecutive_skips)
            scheduler.step()

        # 6. Weight sync: the engine generates the next batch with the updated weights (rollout.sync wakes it).
        with timed(times, "sync"):
            sync_info = parts.sync_weights()

        # 7. Metrics (grad_norm: of the last optimizer step), warnings, samples, held-out scores, checkpoint.
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
