"""The SFT loop (cold start before RL): next-token loss on completion tokens only, read top to bottom.

Batches are padded (prompt left, completion right: the same layout as the RL passes), the loss is the mean
over the completion tokens of the whole step (all micro-batches and ranks), so gradient accumulation does
not change the gradient; the learning rate follows warmup + constant/linear/cosine.
"""
from __future__ import annotations

import time

import torch

from grpo.evaluate import evaluation_due, summarize
from grpo.losses import aggregate, loss_denominator
from grpo.parts import Collectives, SFTParts
from grpo.trainer import held_out, timed
from grpo.update import optimizer_step
from models.batching import pad_batch
from models.logprobs import completion_logprobs

SFT_AGG = "token-mean"  # every completion token of the step weighs the same


def train_sft(parts: SFTParts, dist: Collectives) -> dict:
    """Run parts.spec.steps SFT steps from parts.checkpoints.start_step on parts.examples. Returns {"final": the
    last step's metrics, "before"/"after": the held-out results} as grpo.trainer.train_rl does."""
    spec, log, start = parts.spec, parts.log, parts.checkpoints.start_step
    model, optimizer, scheduler = parts.policy.model, parts.policy.optimizer, parts.policy.scheduler
    results, skips, metrics = {}, 0, {}
    if parts.evaluate and spec.evaluation.before:
        results["before"] = held_out(parts, start)
        if spec.evaluation.every and start == 0:
            log.metrics(0, summarize(results["before"]))  # the curve's starting point
    for step in range(start, spec.steps):
        started = time.perf_counter()
        with timed({}, "update", step + 1):
            examples = [parts.examples[i] for i in parts.sampler.next(spec.batch_size)]
            batches = [pad_batch([p for p, _ in examples[s:s + spec.micro_batch_size]],
                                 [c for _, c in examples[s:s + spec.micro_batch_size]], parts.pad_id)
                       for s in range(0, len(examples), spec.micro_batch_size)]
            # Global token count of the step: every token weighs the same however the batch is split.
            local_tokens = sum(loss_denominator(batch["completion_mask"], SFT_AGG) for batch in batches)
            num_tokens = dist.all_reduce_sum(torch.as_tensor(local_tokens, dtype=torch.float32, device=dist.device))
            loss_sum = 0.0
            for batch in batches:
                logprobs, _ = completion_logprobs(model, batch, chunk_size=spec.chunk_size)
                loss = aggregate(-logprobs, batch["completion_mask"], SFT_AGG, denominator=num_tokens)
                loss.backward()
                loss_sum += float(loss.detach())
            lr = scheduler.get_last_lr()[0]
            grad_norm, skips = optimizer_step(model, optimizer, dist, log, step=step, loss=loss_sum,
                                              grad_clip=spec.grad_clip, skips=skips,
                                              max_skips=spec.max_consecutive_skips)
            scheduler.step()
        elapsed = time.perf_counter() - started
        loss_value = float(dist.all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64, device=dist.device)))
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "skipped": float(skips > 0),
                   "tokens": float(num_tokens), "tokens_per_s": float(num_tokens) / dist.world_size / elapsed,
                   "time_step": elapsed}
        if parts.evaluate and (step + 1 == spec.steps or evaluation_due(step + 1, spec.evaluation.every, spec.steps)):
            results["after"] = held_out(parts, step + 1)
            if spec.evaluation.every:  # a point of the held-out curve
                metrics.update(summarize(results["after"]))
        log.metrics(step + 1, metrics, postfix_keys=("loss",))
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return {"final": metrics, **results}
