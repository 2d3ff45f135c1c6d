"""The SFT loop (cold start before RL): next-token loss on completion tokens only, read top to bottom.

Batches are padded (prompt left, completion right: the same layout as the RL passes), the loss is the mean
over the completion tokens of the whole step (all micro-batches and ranks), so gradient accumulation does
not change the gradient; the learning rate follows warmup + constant/linear/cosine.
"""
from __future__ import annotations

import math
import time

import torch

from models.batching import pad_batch
from models.logprobs import completion_logprobs


def train_sft(cfg, dist, parts) -> dict:
    """Run cfg.trainer.steps SFT steps from parts.start_step on parts.examples [(prompt_ids, target_ids)]."""
    tcfg = cfg.trainer
    model, optimizer, scheduler, log = parts.model, parts.optimizer, parts.scheduler, parts.log
    skips, metrics = 0, {}
    for step in range(parts.start_step, tcfg.steps):
        started = time.perf_counter()
        examples = [parts.examples[i] for i in parts.sampler.next(tcfg.sft_batch_size)]
        batches = [pad_batch([p for p, _ in examples[s:s + tcfg.micro_batch_size]],
                             [c for _, c in examples[s:s + tcfg.micro_batch_size]], parts.pad_id)
                   for s in range(0, len(examples), tcfg.micro_batch_size)]
        # Global token count of the step: every token weighs the same however the batch is split.
        local_tokens = sum(batch["completion_mask"].sum() for batch in batches)
        num_tokens = dist.all_reduce_sum(torch.as_tensor(local_tokens, dtype=torch.float32, device=dist.device))
        loss_sum = 0.0
        for batch in batches:
            logprobs, _ = completion_logprobs(model, batch, chunk_size=cfg.model.logprob_chunk_size)
            mask = batch["completion_mask"].to(logprobs.dtype)
            loss = -(logprobs * mask).sum() / num_tokens.clamp(min=1)
            loss = loss * parts.loss_scale_hook(step)  # 1.0 except in fault-injection tests
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        loss_value = float(dist.all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64, device=dist.device)))
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            skips += 1
            optimizer.zero_grad(set_to_none=True)
            log.warn(f"step {step}: non-finite loss ({loss_value}) or grad norm ({grad_norm}); step skipped")
            if skips >= tcfg.max_consecutive_skips:
                raise RuntimeError(f"{skips} consecutive SFT steps skipped for non-finite loss/gradients "
                                   f"(trainer.max_consecutive_skips={tcfg.max_consecutive_skips}); stopping")
        else:
            skips = 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        elapsed = time.perf_counter() - started
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "skipped": float(skips > 0),
                   "tokens": float(num_tokens), "tokens_per_s": float(num_tokens) / dist.world_size / elapsed,
                   "time_step": elapsed}
        log.metrics(step + 1, metrics, postfix_keys=("loss",))
        if parts.finish_step(step + 1, tcfg):  # Ctrl-C: stop here, at a step boundary (a consistent checkpoint)
            break
    parts.save(parts.completed_steps)
    return metrics
