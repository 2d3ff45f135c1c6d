"""The RL loop (GRPO, DAPO, Dr. GRPO, process-reward GRPO): one function, read top to bottom.

Variants are config values, not subclasses. Every line of math is a call into grpo/ (advantages, losses,
shaping, filters) or models/ (logprobs); launch/build.py makes the parts this loop receives.
Deliberate choices, each cited where it happens:
- one optimizer step per PPO epoch over the whole rollout batch, so with ppo_epochs=1 the old logprobs ARE
  the current ones detached and no extra forward pass is spent on them (verl/TRL do the same);
- the loss divides by the token (or sequence) count of the WHOLE step over all micro-batches and ranks,
  and FSDP's gradient averaging is off, so micro-batching and world size do not change the gradient;
- a non-finite loss or gradient skips the optimizer step (all ranks agree) and is logged.
"""
from __future__ import annotations

import math
import time

import torch

from grpo.advantages import group_advantages, shaped_advantages
from grpo.groups import collect_groups
from grpo.losses import aggregate, kl_penalty, loss_denominator, policy_loss, truncated_is_weights
from grpo.metrics import reduce_metrics, step_metrics
from grpo.shaping import overlong_penalty
from models.batching import pad_batch
from models.logprobs import completion_logprobs
from models.lora import disabled_adapters


def _micro_batches(size: int, micro: int) -> list[slice]:
    return [slice(start, min(start + micro, size)) for start in range(0, size, micro)]


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for b, row in enumerate(rows):
        out[b, : row.shape[0]] = row
    return out


def train_rl(cfg, dist, parts) -> dict:
    """Run cfg.trainer.steps RL steps from parts.start_step. Returns the last step's metrics."""
    algo, roll, tcfg = cfg.algorithm, cfg.rollout, cfg.trainer
    model, engine, optimizer, scheduler, log = parts.model, parts.engine, parts.optimizer, parts.scheduler, parts.log
    group_size, max_len = roll.n, roll.max_new_tokens
    sampling = dict(max_new_tokens=max_len, temperature=roll.temperature, top_p=roll.top_p, top_k=roll.top_k,
                    stop=roll.stop)
    skips, streaks, metrics = 0, {"truncation_rate": 0, "flat_group_frac": 0}, {}
    for step in range(parts.start_step, tcfg.steps):
        times, started = {}, time.perf_counter()

        # 1. Rollout and rewards: P prompts x G completions per rank; DAPO keeps only informative groups.
        groups = collect_groups(
            engine, parts.sampler, parts.rows, parts.prompt_ids, num_prompts=tcfg.prompts_per_step,
            group_size=group_size, sampling=sampling, seed=cfg.seed * 1_000_003 + step * dist.world_size + dist.rank,
            compute_score=parts.compute_score, decode_prefixes=parts.decode_prefixes,
            sentence_coef=cfg.reward.sentence_coef, correct_threshold=cfg.reward.correct_threshold,
            dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_gen_batches)
        engine.sleep()  # vLLM on GPUs: free the KV cache and offload weights while the trainer runs (no-op on CPU)
        times["rollout_reward"] = time.perf_counter() - started
        completions = groups.completions
        lengths = torch.tensor([len(c.completion_ids) for c in completions], dtype=torch.float32)

        # 2. Advantages: DAPO's overlong penalty joins the reward; sentence rewards shape per-token returns.
        rewards = groups.rewards.clone()
        if algo.overlong_cache_len > 0:
            rewards += overlong_penalty(lengths, max_len, algo.overlong_cache_len, algo.overlong_factor)
        width = int(lengths.max())
        mask = _padded([torch.ones(int(n)) for n in lengths], width) * groups.loss_weight[:, None]
        shaping = _padded(groups.token_shaping, width)
        if shaping.abs().sum() > 0:
            advantages = shaped_advantages(rewards, shaping, mask, group_size, scale=algo.adv_scale, eps=algo.adv_eps)
        else:
            advantages = group_advantages(rewards, group_size, scale=algo.adv_scale, eps=algo.adv_eps)[:, None] * mask
        shaped_fraction = float(((shaping != 0).float() * mask).sum() / mask.sum().clamp(min=1))
        rollout_logprobs = _padded([torch.tensor(c.logprobs, dtype=torch.float32) for c in completions], width)

        # 3. Micro-batches and the step's global loss denominator (one all-reduce per step).
        slices = _micro_batches(len(completions), tcfg.micro_batch_size)
        batches = [pad_batch([c.prompt_ids for c in completions[s]], [c.completion_ids for c in completions[s]],
                             parts.pad_id) for s in slices]
        denominator = dist.all_reduce_sum(loss_denominator(mask, algo.agg).to(dist.device))

        # 4. Old and reference logprobs (skipped when there is one update per rollout: old = current, detached).
        started = time.perf_counter()
        old_logprobs, ref_logprobs = [], []
        with torch.no_grad():
            for batch in batches:
                if algo.ppo_epochs > 1:
                    old_logprobs.append(completion_logprobs(model, batch, temperature=roll.temperature,
                                                            chunk_size=cfg.model.logprob_chunk_size)[0])
                if parts.ref_model is not None:
                    ref_logprobs.append(completion_logprobs(parts.ref_model, batch, temperature=roll.temperature,
                                                            chunk_size=cfg.model.logprob_chunk_size)[0])
                elif parts.reference_from_adapters:  # LoRA: the reference is the policy with its adapters off
                    with disabled_adapters(model):
                        ref_logprobs.append(completion_logprobs(model, batch, temperature=roll.temperature,
                                                                chunk_size=cfg.model.logprob_chunk_size)[0])
        times["logprob"] = time.perf_counter() - started

        # 5. Update: ppo_epochs optimizer steps over the rollout batch, micro-batched.
        started, lr = time.perf_counter(), scheduler.get_last_lr()[0]
        updates = []
        for epoch in range(algo.ppo_epochs):
            loss_total, nonfinite = 0.0, False
            for i, (rows, batch) in enumerate(zip(slices, batches)):
                columns = batch["completion_mask"].shape[1]
                mb_mask, mb_adv = mask[rows, :columns], advantages[rows, :columns]
                logprobs, entropy = completion_logprobs(model, batch, temperature=roll.temperature,
                                                        chunk_size=cfg.model.logprob_chunk_size,
                                                        with_entropy=epoch == 0)
                old = old_logprobs[i] if old_logprobs else logprobs.detach()
                is_weights = None
                if algo.tis_cap is not None:
                    is_weights = truncated_is_weights(old, rollout_logprobs[rows, :columns], cap=algo.tis_cap,
                                                      level=algo.tis_level, mask=mb_mask)
                loss, loss_metrics = policy_loss(
                    logprobs, old, mb_adv, mb_mask, clip_low=algo.clip_low, clip_high=algo.clip_high,
                    dual_clip=algo.dual_clip, agg=algo.agg, denominator=denominator, max_len=max_len,
                    is_weights=is_weights)
                if ref_logprobs:
                    kl_values = kl_penalty(logprobs, ref_logprobs[i], algo.kl_kind)
                    loss = loss + algo.kl_coef * aggregate(kl_values, mb_mask, algo.agg, denominator=denominator,
                                                           max_len=max_len)
                    loss_metrics["kl"] = (kl_values.detach() * mb_mask).sum() / mb_mask.sum().clamp(min=1)
                loss = loss * parts.loss_scale_hook(step)  # 1.0 except in fault-injection tests
                loss.backward()
                loss_total += float(loss.detach())
                nonfinite |= not math.isfinite(float(loss.detach()))
                updates.append({**{k: float(v) for k, v in loss_metrics.items()},
                                "entropy": float((entropy.detach() * mb_mask).sum() / mb_mask.sum().clamp(min=1))
                                if entropy is not None else float("nan"),
                                "logprob_gap": float(((old - rollout_logprobs[rows, :columns]).abs() * mb_mask).sum()
                                                     / mb_mask.sum().clamp(min=1)) if epoch == 0 else float("nan"),
                                "tokens": float(mb_mask.sum())})
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            # Every rank must take the same decision: the grad norm is global, the loss flag is reduced.
            bad = dist.all_reduce_max(torch.tensor(float(nonfinite or not math.isfinite(grad_norm)),
                                                   device=dist.device))
            if bool(bad > 0):
                skips += 1
                optimizer.zero_grad(set_to_none=True)
                log.warn(f"step {step}: non-finite loss ({loss_total}) or grad norm ({grad_norm}); optimizer step "
                         f"skipped ({skips} in a row)")
                if skips >= tcfg.max_consecutive_skips:
                    raise RuntimeError(f"{skips} consecutive optimizer steps skipped for non-finite loss/gradients "
                                       f"(trainer.max_consecutive_skips={tcfg.max_consecutive_skips}); stopping "
                                       f"without writing a checkpoint from these weights")
            else:
                skips = 0
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        times["update"] = time.perf_counter() - started

        # 6. Weight sync: the engine generates the next batch with the updated weights.
        started = time.perf_counter()
        engine.wake()  # weights back first; the sync then overwrites them (vLLM wakes weights, then the KV cache)
        sync_info = parts.sync_weights()
        times["sync"] = time.perf_counter() - started

        # 7. Metrics, warnings, samples, checkpoint.
        metrics = step_metrics(groups, rewards, lengths, max_len, group_size, updates, times,
                               grad_norm=grad_norm, lr=lr, skipped=float(skips > 0),
                               sync_info=sync_info)
        metrics["shaped_token_frac"] = shaped_fraction  # is the sentence reward touching any token?
        metrics = reduce_metrics(metrics, dist)
        if metrics["flat_group_frac"] == 1.0 and algo.kl_coef == 0:
            log.warn(f"step {step + 1}: zero learning signal -- every group's rewards are identical")
        for key, threshold in (("truncation_rate", tcfg.warn_truncation), ("flat_group_frac", tcfg.warn_flat_groups)):
            streaks[key] = streaks[key] + 1 if metrics[key] > threshold else 0
            if streaks[key] >= tcfg.warn_after_steps:
                log.warn(f"{key} = {metrics[key]:.2f} > {threshold} for {streaks[key]} steps: little or no learning "
                         f"signal (raise rollout.max_new_tokens / check the reward)")
        log.metrics(step + 1, metrics, postfix_keys=("reward_mean", "acc", "format_rate"))
        log.samples(step + 1, [{"prompt": row["prompt"][-1]["content"], "completion": c.text, "reward": float(r),
                                "correct": float(ok), "finish_reason": c.finish_reason}
                               for c, r, ok, row in list(zip(completions, rewards, groups.correct, groups.rows))[:group_size]])
        if parts.finish_step(step + 1, tcfg):  # Ctrl-C: stop here, at a step boundary (a consistent checkpoint)
            break
    parts.save(parts.completed_steps)
    return metrics
