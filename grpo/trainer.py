"""The RL loop (GRPO, DAPO, Dr. GRPO, GSPO, RLOO, REINFORCE++, CISPO, process-reward GRPO) and the SFT loop (cold
start before RL), each one function read top to bottom; docs/how_a_step_runs.md walks an RL step's phases.
Variants are settings of the Config, not subclasses. What is global under torchrun is reduced where it is computed
(docs/conventions.md, "What is global under torchrun"); `dist` is launch.dist.DistInfo. An RL step's metrics (TRL-style
names), their reduction over ranks, and the warnings that catch silent no-learning (flat groups, truncation) are here
too: they are the loop's logging."""
from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.advantages import flat_groups
from grpo.config import Config, TrainerConfig
from grpo.evaluate import summarize
from grpo.groups import PromptSampler, Rollout, format_success
from grpo.losses import aggregate, loss_denominator, masked_mean
from grpo.update import optimizer_step, prepare, update
from models.logprobs import completion_logprobs, pad_batch

EXIT_STALLED = 124  # as coreutils' timeout(1)
SFT_AGG = "token-mean"  # every completion token of an SFT step weighs the same


class StepFailed(RuntimeError):
    """A failure inside a loop, with the phase it happened in and the step; the error itself is the cause."""

    def __init__(self, phase: str, step: int | None, error: BaseException):
        super().__init__(f"{phase} failed at step {step}: {type(error).__name__}: {error}")
        self.phase, self.step = phase, step


@contextmanager
def phase(name: str, step: int | None, times: dict | None = None):
    """A phase of a step: its time adds to times[name]; a failure in it leaves as StepFailed naming it and the step."""
    started = time.perf_counter()
    try:
        yield
    except StepFailed:
        raise
    except Exception as error:
        raise StepFailed(name, step, error) from error
    if times is not None:
        times[name] = times.get(name, 0.0) + time.perf_counter() - started


def _expire(step: int, rank: int, seconds: float) -> None:
    print(f"error: weight sync (phase: sync) at step {step} on rank {rank} did not finish within "
          f"rollout.sync_timeout_s={seconds:g} s: ending the run (exit code {EXIT_STALLED}); the stack of every thread "
          "follows", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(EXIT_STALLED)  # the stalled thread cannot be unwound; checkpoints already written stay complete


@contextmanager
def sync_deadline(seconds: float, step: int, rank: int):
    """A weight sync, which can stall where no exception reaches it (blocked inside a C call): past `seconds`
    (rollout.sync_timeout_s) a timer prints that the sync of `step` on `rank` stalled and every thread's stack, and
    ends the process with EXIT_STALLED; under torchrun the other ranks then fail at their next collective."""
    timer = threading.Timer(seconds, _expire, args=(step, rank, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        # Joined: no timer thread may be left winding down during interpreter finalization (one that held the last
        # reference to the run's tensors once ended a finished run in std::terminate, SIGABRT).
        timer.join()


class Log(Protocol):
    """The run directory's logs (launch.runlog.RunLog); a no-op on ranks other than 0."""

    def metrics(self, step: int, metrics: dict, postfix_keys: tuple[str, ...] = ...) -> None: ...
    def samples(self, step: int, samples: list[dict]) -> None: ...
    def warn(self, message: str) -> None: ...


class Checkpoints(Protocol):
    """launch.checkpointing.Checkpointer: the start step; end_step checkpoints when due, True on a stop request."""
    start_step: int

    def end_step(self, done: int) -> bool: ...
    def finish(self) -> None: ...


@dataclass(frozen=True)
class Policy:
    """The model being trained (FSDP2-sharded under torchrun), its optimizer and learning-rate schedule."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True, kw_only=True)
class Parts:
    """What the loops run on, built once by launch/build.py."""
    cfg: Config
    policy: Policy
    rollout: Rollout | None  # RL's batches and weight sync; the held-out evaluation of both loops (None: no engine)
    log: Log
    checkpoints: Checkpoints
    pad_id: int
    vocab_size: int | None = None  # the ids the engines can sample: the trainer normalises over them
    reference: torch.nn.Module | None = None  # the KL reference (the policy itself with LoRA: adapters off)
    teacher: torch.nn.Module | None = None  # on-policy distillation's frozen teacher
    examples: Sequence[tuple[list[int], list[int], list[int]]] = ()  # SFT: (prompt, target ids, target mask) per row
    sampler: PromptSampler | None = None  # SFT: this rank's order over the examples


def held_out_due(done: int, start: int, trainer: TrainerConfig) -> bool:
    """Whether the held-out rows are scored after `done` steps of a run started at `start` (also launch/separate)."""
    if done == start:
        return trainer.eval_before
    return done == trainer.steps or (trainer.eval_every > 0 and done % trainer.eval_every == 0)


def held_out(parts: Parts, done: int, start: int, results: dict, *, sync: bool = False) -> dict:
    """Score the held-out rows after `done` steps when held_out_due, into results["before"] (done == start) or
    ["after"]; sync: push the weights into the engine first (SFT). Returns the curve's point to log, or {}."""
    if parts.rollout is None or not held_out_due(done, start, parts.cfg.trainer):
        return {}
    with phase("held-out evaluation", done):
        if sync:
            parts.rollout.sync_weights()
        result = parts.rollout.evaluate(done)
    if result is None:  # no held-out rows
        return {}
    results["before" if done == start else "after"] = result
    return summarize(result) if parts.cfg.trainer.eval_every else {}


def _nanmean(values) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def step_metrics(batch, rewards: Tensor, group_size: int, updates: list[dict], times: dict, *, grad_norm: float,
                 lr: float, skipped: float, sync_info: dict, step: int = 0) -> dict:
    """Everything one step logs. rewards: [B] the advantages' (penalties included); `updates`: one dict per
    micro-batch update, epoch 0 first. Per-update metrics come from the updates that trained on some token (a
    micro-batch of filler groups has no ratio); a rank with none reports NaN, which reduce_metrics skips."""
    trained = [u for u in updates if u["tokens"] > 0]
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "acc": float(batch.correct.mean()),
        "flat_group_frac": float(flat_groups(rewards, group_size).float().mean()),
        "kept_group_frac": float(batch.loss_weight.view(-1, group_size)[:, 0].mean()),
        "gen_rounds": float(batch.rounds),
        "staleness": float(step - batch.policy_version),  # 0 on-policy; 1 one step off (rollout.placement=separate)
        "shaped_token_frac": float(masked_mean((batch.token_shaping != 0).float(), batch.mask)),  # sentence reward on?
        "truncation_rate": sum(c.finish_reason == "length" for c in batch.completions) / len(batch.completions),
        "response_length_mean": float(batch.lengths.mean()),
        "response_length_max": float(batch.lengths.max()),
        "grad_norm": grad_norm,
        "lr": lr,
        "skipped": skipped,
        "tokens_per_s": float(batch.lengths.sum()) / max(sum(times.values()), 1e-9),
        "trained_tokens": sum(u["tokens"] for u in updates),
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
    if stats := [c.tool_stats for c in batch.completions if c.tool_stats is not None]:  # multi-turn, per trajectory
        metrics.update({name: sum(s[key] for s in stats) / len(stats) for name, key in (
            ("turns_mean", "turns"), ("tool_calls", "calls"), ("tool_errors", "error"), ("tool_timeouts", "timeout"))})
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


def train_rl(parts: Parts, dist) -> dict:
    """Run trainer.steps RL steps from parts.checkpoints.start_step. Returns {"final": the last step's metrics,
    "before": the held-out result at the start, "after": at the end} (held-out entries only with held-out rows)."""
    cfg, log, start = parts.cfg, parts.log, parts.checkpoints.start_step
    watch = NoSignalWatch(cfg)
    results, metrics, skips = {}, {}, 0
    if (point := held_out(parts, start, start, results)) and start == 0:
        log.metrics(0, point)  # the curve's starting point
    for step in range(start, cfg.trainer.steps):
        times: dict[str, float] = {}
        lr = parts.policy.scheduler.get_last_lr()[0]
        with phase("rollout_reward", step + 1, times):
            batch = parts.rollout.collect(step)
        with phase("logprob", step + 1, times):
            prepared = prepare(parts, batch, dist)
        with phase("update", step + 1, times):
            result = update(parts, prepared, dist, step=step, skips=skips)
            skips = result.skips
            parts.policy.scheduler.step()
        with phase("sync", step + 1, times), sync_deadline(cfg.rollout.sync_timeout_s, step + 1, dist.rank):
            sync_info = parts.rollout.sync_weights()

        metrics = reduce_metrics(step_metrics(batch, prepared.rewards, cfg.rollout.n, result.records, times,
                                              grad_norm=result.grad_norm, lr=lr, skipped=float(skips > 0),
                                              sync_info=sync_info, step=step), dist)
        # Each rank's share of a loss divided by the whole step's count: their sum is the step's loss.
        metrics["loss"] = float(dist.all_reduce_sum(torch.tensor(result.loss, dtype=torch.float64, device=dist.device)))
        metrics.update(held_out(parts, step + 1, start, results))
        for warning in watch.update(metrics, step + 1):
            log.warn(warning)
        log.metrics(step + 1, metrics, postfix_keys=("reward_mean", "acc", "format_rate"))
        log.samples(step + 1, [  # the step's first group, for samples.jsonl
            {"prompt": row["prompt"][-1]["content"], "completion": c.text, "reward": float(r), "correct": float(ok),
             "finish_reason": c.finish_reason}
            for c, r, ok, row in zip(batch.completions[:cfg.rollout.n], prepared.rewards, batch.correct, batch.rows)])
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return {"final": metrics, **results}


def sft_batch(examples: Sequence[tuple[list[int], list[int], list[int]]], pad_id: int) -> dict:
    """pad_batch of (prompt, target, target mask) examples, its completion_mask 0 where the target's mask is
    (tool messages in a multi-turn target: rollout.tools.sft_target)."""
    batch = pad_batch([p for p, _, _ in examples], [c for _, c, _ in examples], pad_id)
    for row, (_, _, mask) in enumerate(examples):
        batch["completion_mask"][row, :len(mask)] *= torch.tensor(mask, dtype=batch["completion_mask"].dtype)
    return batch


def train_sft(parts: Parts, dist) -> dict:
    """Next-token loss on completion tokens only, for trainer.steps steps from parts.checkpoints.start_step: the mean
    over the completion tokens of the whole step (all micro-batches and ranks), so gradient accumulation does not
    change the gradient. Returns {"final", "before", "after"} as train_rl does."""
    cfg, log, start = parts.cfg, parts.log, parts.checkpoints.start_step
    model, trainer = parts.policy.model, cfg.trainer
    results, skips, metrics = {}, 0, {}
    if (point := held_out(parts, start, start, results)) and start == 0:
        log.metrics(0, point)  # the curve's starting point
    for step in range(start, trainer.steps):
        started = time.perf_counter()
        with phase("update", step + 1):
            examples = [parts.examples[i] for i in parts.sampler.next(trainer.sft_batch_size)]
            size = trainer.micro_batch_size
            batches = [sft_batch(examples[s:s + size], parts.pad_id) for s in range(0, len(examples), size)]
            local_tokens = sum(loss_denominator(batch["completion_mask"], SFT_AGG) for batch in batches)
            num_tokens = dist.all_reduce_sum(torch.as_tensor(local_tokens, dtype=torch.float32, device=dist.device))
            loss_sum = 0.0
            for batch in batches:
                logprobs, _ = completion_logprobs(model, batch, chunk_size=cfg.model.logprob_chunk_size)
                loss = aggregate(-logprobs, batch["completion_mask"], SFT_AGG, denominator=num_tokens)
                loss.backward()
                loss_sum += float(loss.detach())
            lr = parts.policy.scheduler.get_last_lr()[0]
            grad_norm, skips = optimizer_step(parts.policy, cfg, dist, log, step=step, loss=loss_sum, skips=skips)
            parts.policy.scheduler.step()
        elapsed = time.perf_counter() - started
        metrics = {"loss": float(dist.all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64, device=dist.device))),
                   "grad_norm": grad_norm, "lr": lr, "skipped": float(skips > 0), "tokens": float(num_tokens),
                   "tokens_per_s": float(num_tokens) / dist.world_size / elapsed, "time_step": elapsed}
        metrics.update(held_out(parts, step + 1, start, results, sync=True))
        log.metrics(step + 1, metrics, postfix_keys=("loss",))
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return {"final": metrics, **results}
