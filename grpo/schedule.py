"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor."""
from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str = "constant",
              min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based).

    Warmup ramps linearly from 1/(warmup+1) to 1 so the first step is not wasted at lr 0.

    >>> [round(lr_factor(s, warmup_steps=2, total_steps=6, schedule="linear"), 4) for s in range(6)]
    [0.3333, 0.6667, 1.0, 0.6667, 0.3333, 0.0]
    >>> round(lr_factor(3, warmup_steps=0, total_steps=7, schedule="cosine", min_ratio=0.1), 4)
    0.55
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; valid: constant, linear, cosine")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay
