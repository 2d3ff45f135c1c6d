"""The end of every optimizer step, shared by the SFT and RL loops: clip to the global gradient norm, and step
only when the loss and the norm are finite on every rank; otherwise skip, say so, and stop after too many.
The learning-rate schedule is the loops' own: it advances once per training step (an RL step may take several
optimizer steps, one per PPO mini-batch and epoch, all at the step's learning rate, as verl does).
"""
from __future__ import annotations

import math

import torch

from grpo.parts import Collectives, Log


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
