"""The RL loop (GRPO, DAPO, Dr. GRPO, GSPO, RLOO, REINFORCE++, CISPO, process-reward GRPO) and the SFT loop (cold
start before RL), each one function read top to bottom; docs/how_a_step_runs.md walks an RL step's phases.
Variants are settings of the Config, not subclasses. What is global under torchrun is reduced where it is computed
(docs/conventions.md, "What is global under torchrun"); `dist` is launch.dist.DistInfo."""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from grpo.config import Config, TrainerConfig
from grpo.evaluate import summarize
from grpo.groups import PromptSampler, Rollout
from grpo.losses import aggregate, loss_denominator
from grpo.metrics import NoSignalWatch, reduce_metrics, step_metrics
from grpo.update import optimizer_step, prepare, update
from models.batching import pad_batch
from models.logprobs import completion_logprobs

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


def _expire(what: Callable[[], str], limit: str) -> None:
    print(f"error: {what()} did not finish within {limit}: ending the run (exit code {EXIT_STALLED}); the stack "
          "of every thread follows", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(EXIT_STALLED)  # the stalled thread cannot be unwound; checkpoints already written stay complete


@contextmanager
def deadline(seconds: float, limit: str, what: Callable[[], str]):
    """Work that can stall where no exception reaches it (a weight sync blocked inside a C call): past `seconds` a
    timer prints what() stalled, `limit` (e.g. "rollout.sync_timeout_s=60 s") and every thread's stack, and ends
    the process with EXIT_STALLED; under torchrun the other ranks then fail at their next collective."""
    timer = threading.Timer(seconds, _expire, args=(what, limit))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        # Joined: a daemon timer thread winding down during interpreter finalization could drop the last reference
        # to `what`'s closure (and the run's tensors), ending a finished run in std::terminate (SIGABRT).
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
    examples: Sequence[tuple[list[int], list[int]]] = ()  # SFT: (prompt ids, target ids) per training row
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
        with phase("sync", step + 1, times), deadline(
                cfg.rollout.sync_timeout_s, f"rollout.sync_timeout_s={cfg.rollout.sync_timeout_s:g} s",
                lambda: f"weight sync (phase: sync) at step {step + 1} on rank {dist.rank}"):
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
            batches = [pad_batch([p for p, _ in examples[s:s + size]], [c for _, c in examples[s:s + size]],
                                 parts.pad_id) for s in range(0, len(examples), size)]
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
        loss_value = float(dist.all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64, device=dist.device)))
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "skipped": float(skips > 0),
                   "tokens": float(num_tokens), "tokens_per_s": float(num_tokens) / dist.world_size / elapsed,
                   "time_step": elapsed}
        metrics.update(held_out(parts, step + 1, start, results, sync=True))
        log.metrics(step + 1, metrics, postfix_keys=("loss",))
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return {"final": metrics, **results}
