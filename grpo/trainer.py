"""The RL loop (GRPO, DAPO, Dr. GRPO, GSPO, RLOO, REINFORCE++, CISPO, process-reward GRPO): one function, read
top to bottom, one call per phase of a step.

    rollout  (rollout, grpo.groups)        P prompts x G completions per rank, scored; DAPO keeps informative groups
    prepare  (grpo.prepare.prepare)        the update's plan, old/reference logprobs, rewards, advantages
    update   (grpo.update.update)          ppo_epochs passes over the mini-batches, one optimizer step each
    sync     (parts.sync_weights)          the engine gets the updated weights

Variants are spec values (grpo/parts.py, built from the config in launch/build.py), not subclasses. What is
global under torchrun (loss denominators, batch statistics, the gradient norm, the skip decision) is reduced
where it is computed; everything else is per rank, exact because a group never spans two ranks.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from grpo.evaluate import evaluation_due, summarize
from grpo.groups import collect_groups
from grpo.metrics import NoSignalWatch, reduce_metrics, step_metrics
from grpo.parts import Collectives, RLParts, StepFailed
from grpo.prepare import prepare
from grpo.update import update
from rollout.engine import stream_seed


@contextmanager
def timed(times: dict, phase: str, step: int | None):
    """Time a phase into times[phase]; a failure in it leaves as StepFailed naming the phase and the step."""
    started = time.perf_counter()
    try:
        yield
    except StepFailed:
        raise
    except Exception as error:
        raise StepFailed(phase, step, error) from error
    times[phase] = times.get(phase, 0.0) + time.perf_counter() - started


def held_out(parts, step: int) -> dict:
    """The held-out evaluation after step `step` (0: before the first), through parts.evaluate."""
    with timed({}, "held-out evaluation", step):
        return parts.evaluate(step)


def train_rl(parts: RLParts, dist: Collectives) -> dict:
    """Run parts.spec.steps RL steps from parts.checkpoints.start_step. Returns {"final": the last step's metrics,
    "before": the held-out result at the start, "after": at the end} (held-out entries only with held-out rows)."""
    spec, log, start = parts.spec, parts.log, parts.checkpoints.start_step
    watch = NoSignalWatch(spec.watch, spec.loss.kl_coef + spec.advantage.kl_coef)
    results, metrics, skips = {}, {}, 0
    if parts.evaluate and spec.evaluation.before:
        results["before"] = held_out(parts, start)
        if spec.evaluation.every and start == 0:
            log.metrics(0, summarize(results["before"]))  # the curve's starting point
    for step in range(start, spec.steps):
        times: dict[str, float] = {}
        lr = parts.policy.scheduler.get_last_lr()[0]
        with timed(times, "rollout_reward", step + 1):
            batch = rollout(parts, dist, step)
        with timed(times, "logprob", step + 1):
            prepared = prepare(parts, batch, dist)
        with timed(times, "update", step + 1):
            result = update(parts.policy, prepared, spec, dist, log, step=step, skips=skips)
            skips = result.skips
            parts.policy.scheduler.step()
        with timed(times, "sync", step + 1):
            sync_info = parts.sync_weights()  # rollout.sync wakes the engine around the new weights

        metrics = reduce_metrics(step_metrics(batch, prepared.rewards, spec.batching.group_size, result.records,
                                              times, grad_norm=result.grad_norm, lr=lr, skipped=float(skips > 0),
                                              sync_info=sync_info, step=step), dist)
        if parts.evaluate and (step + 1 == spec.steps or evaluation_due(step + 1, spec.evaluation.every, spec.steps)):
            results["after"] = held_out(parts, step + 1)
            if spec.evaluation.every:  # a point of the held-out curve
                metrics.update(summarize(results["after"]))
        for warning in watch.update(metrics, step + 1):
            log.warn(warning)
        log.metrics(step + 1, metrics, postfix_keys=("reward_mean", "acc", "format_rate"))
        log.samples(step + 1, first_group_samples(batch, prepared.rewards, spec.batching.group_size))
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return {"final": metrics, **results}


def rollout(parts: RLParts, dist: Collectives, step: int):
    """This rank's P prompts x G completions of step `step`, scored (grpo.groups.Batch): from the rollout ranks when
    they run apart (parts.remote), else from this rank's engine, whose memory is then freed for the update. The
    ranks of a tensor-parallel replica submit the same requests and keep their own shares."""
    if parts.remote is not None:
        return parts.remote.collect(step)
    spec = parts.spec
    batch = collect_groups(
        parts.engine, parts.sampler, parts.rows, parts.prompt_ids, parts.scorer,
        num_prompts=spec.batching.prompts_per_step, group_size=spec.batching.group_size,
        sampling=spec.sampling.kwargs(), seed=stream_seed(spec.seed, step, dist.dp_rank),
        dynamic_sampling=spec.dynamic_sampling, max_rounds=spec.max_gen_batches, shares=dist.tp_size,
        share=dist.tp_rank)
    batch.policy_version = step
    parts.engine.sleep()  # vLLM on GPUs: free weights and KV cache while the trainer runs (no-op on CPU)
    return batch


def first_group_samples(batch, rewards, group_size: int) -> list[dict]:
    """The first group of a step, for samples.jsonl."""
    return [{"prompt": row["prompt"][-1]["content"], "completion": c.text, "reward": float(r), "correct": float(ok),
             "finish_reason": c.finish_reason}
            for c, r, ok, row in zip(batch.completions[:group_size], rewards, batch.correct, batch.rows)]
