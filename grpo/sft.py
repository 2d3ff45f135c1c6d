"""The SFT loop (cold start before RL): next-token loss on completion tokens only, read top to bottom.

Batches are padded (prompt left, completion right: the same layout as the RL passes), the loss is the mean
over the completion tokens of the whole step (all micro-batches and ranks; grpo.losses' "token-mean"
aggregation, as the RL loss's), so gradient accumulation does not change the gradient; the learning rate
follows warmup + constant/linear/cosine.
"""
from __future__ import annotations

import time

import torch

from grpo.config import Config
from grpo.evaluate import evaluation_due
from grpo.losses import aggregate, loss_denominator
from grpo.parts import Collectives, SFTParts
from grpo.update import optimizer_step
from models.batching import pad_batch
from models.logprobs import completion_logprobs

SFT_AGG = "token-mean"  # every completion token of the step weighs the same


def train_sft(cfg: Config, dist: Collectives, parts: SFTParts) -> dict:
    """Run cfg.trainer.steps SFT steps from parts.checkpoints.start_step on parts.examples."""
    tcfg = cfg.trainer
    model, optimizer, scheduler = parts.policy.model, parts.policy.optimizer, parts.policy.scheduler
    eval_every = tcfg.eval_every if parts.evaluate else 0
    if eval_every and parts.checkpoints.start_step == 0 and tcfg.eval_before:
        parts.log.metrics(0, parts.evaluate(0))  # the curve's starting point
    skips, metrics = 0, {}
    for step in range(parts.checkpoints.start_step, tcfg.steps):
        started = time.perf_counter()
        examples = [parts.examples[i] for i in parts.sampler.next(tcfg.sft_batch_size)]
        batches = [pad_batch([p for p, _ in examples[s:s + tcfg.micro_batch_size]],
                             [c for _, c in examples[s:s + tcfg.micro_batch_size]], parts.pad_id)
                   for s in range(0, len(examples), tcfg.micro_batch_size)]
        # Global token count of the step: every token weighs the same however the batch is split.
        local_tokens = sum(loss_denominator(batch["completion_mask"], SFT_AGG) for batch in batches)
        num_tokens = dist.all_reduce_sum(torch.as_tensor(local_tokens, dtype=torch.float32,
                                                         device=dist.device))
        loss_sum = 0.0
        for batch in batches:
            logprobs, _ = completion_logprobs(model, batch, chunk_size=cfg.model.logprob_chunk_size)
            loss = aggregate(-logprobs, batch["completion_mask"], SFT_AGG, denominator=num_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
        lr = scheduler.get_last_lr()[0]
        grad_norm, skips = optimizer_step(model, optimizer, dist, parts.log, step=step, loss=loss_sum,
                                          grad_clip=cfg.optim.grad_clip, skips=skips,
                                          max_skips=tcfg.max_consecutive_skips)
        scheduler.step()
        elapsed = time.perf_counter() - started
        loss_value = float(dist.all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64,
                                                            device=dist.device)))
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "skipped": float(skips > 0),
                   "tokens": float(num_tokens), "tokens_per_s": float(num_tokens) / dist.world_size / elapsed,
                   "time_step": elapsed}
        if evaluation_due(step + 1, eval_every, tcfg.steps):
            metrics.update(parts.evaluate(step + 1))
        parts.log.metrics(step + 1, metrics, postfix_keys=("loss",))
        if parts.checkpoints.end_step(step + 1):  # a stop request: stop at a step boundary (consistent state)
            break
    parts.checkpoints.finish()
    return metrics
