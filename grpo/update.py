"""The third phase of an RL step, the update: ppo_epochs passes over the mini-batches, one optimizer step each,
one forward/backward per micro-batch; and the end of every optimizer step, shared with the SFT loop: clip to
the global gradient norm, and step only when the loss and the norm are finite on every rank; otherwise skip,
say so, and stop after too many. The learning-rate schedule is the loops' own: it advances once per training
step (an RL step may take several optimizer steps, one per PPO mini-batch and epoch, all at the step's
learning rate, as verl does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo.losses import rl_loss
from grpo.parts import Collectives, Log, Policy, RLSpec


def global_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients to `max_norm` (0: no clipping) and return their norm before clipping. Under FSDP2
    the norm of the sharded gradients is a DTensor whose full value is the global norm over all ranks."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def optimizer_step(model: torch.nn.Module, optimizer, dist: Collectives, log: Log, *, step: int, loss: float,
                   grad_clip: float, skips: int, max_skips: int) -> tuple[float, int]:
    """Clip, then take the optimizer step (or skip it) and zero the gradients.

    loss: this rank's loss of the optimizer step (its sum over micro-batches). Every rank takes the same decision: the
    grad norm is global and the non-finite flag is reduced over ranks. Returns (grad norm, consecutive skips);
    raises RuntimeError when `max_skips` steps in a row were skipped, before any checkpoint of such weights.
    """
    grad_norm = global_grad_norm(model, grad_clip)
    bad = dist.all_reduce_max(torch.tensor(float(not (math.isfinite(loss) and math.isfinite(grad_norm))),
                                           device=dist.device))
    if bool(bad > 0):
        skips += 1
        log.warn(f"step {step}: non-finite loss ({loss}) or grad norm ({grad_norm}) on some rank; optimizer step "
                 f"skipped ({skips} in a row)")
        if skips >= max_skips:
            raise RuntimeError(f"{skips} consecutive optimizer steps skipped for non-finite loss/gradients "
                               f"(trainer.max_consecutive_skips={max_skips}); stopping without writing a "
                               f"checkpoint from these weights")
    else:
        skips = 0
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skips


@dataclass
class UpdateResult:
    records: list[dict]  # one per micro-batch update that ran (epoch 0 first): loss metrics and "tokens"
    grad_norm: float  # of the last optimizer step
    skips: int  # consecutive skipped optimizer steps after this update


def update(policy: Policy, prepared, spec: RLSpec, dist: Collectives, log: Log, *, step: int,
           skips: int) -> UpdateResult:
    """Train on one prepared rollout (grpo.prepare.Prepared). A mini-batch with nothing to train on any rank
    (only DAPO filler groups) takes no step: AdamW would still move the weights on its momentum."""
    from grpo.prepare import logprob_pass
    model, records, grad_norm = policy.model, [], 0.0
    for epoch in range(spec.batching.ppo_epochs):
        for mini in prepared.mini_batches:
            if mini.denominator == 0:
                continue
            loss_sum = 0.0
            for micro in mini.micro_batches:
                logprobs, entropy = logprob_pass(model, spec.logprobs, micro.inputs,
                                                 with_entropy=epoch == 0 or spec.loss.entropy_coef > 0)
                old = micro.take(prepared.old_logprobs) if prepared.old_logprobs is not None else logprobs.detach()
                device = logprobs.device
                loss, metrics = rl_loss(
                    spec.loss, logprobs, old.to(device), micro.take(prepared.advantages).to(device),
                    micro.take(prepared.mask).to(device) * micro.weight, denominator=mini.denominator,
                    rollout_logprobs=micro.take(prepared.rollout_logprobs).to(device),
                    ref_logprobs=_on(micro.take(prepared.ref_logprobs), device), entropy=entropy)
                loss.backward()
                loss_sum += float(loss.detach())
                record = {key: float(value) for key, value in metrics.items()}
                record["tokens"] = float(micro.take(prepared.mask).sum()) * micro.weight
                if epoch > 0:  # the engine gap and the entropy describe the rollout: count them once
                    record.pop("logprob_gap", None), record.pop("entropy", None)
                records.append(record | prepared.metrics)
            grad_norm, skips = optimizer_step(model, policy.optimizer, dist, log, step=step, loss=loss_sum,
                                              grad_clip=spec.grad_clip, skips=skips,
                                              max_skips=spec.max_consecutive_skips)
    return UpdateResult(records, grad_norm, skips)


def _on(tensor, device):
    return None if tensor is None else tensor.to(device)
