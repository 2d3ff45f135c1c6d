"""DAPO's overlong reward shaping: a soft length penalty in the last `cache_len` tokens before the limit."""
from __future__ import annotations

import torch
from torch import Tensor

from grpo.checks import check_ndim


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """Penalty added to the reward of each completion (Yu et al. 2025, DAPO, eq. 13).

    lengths: [B] completion lengths in tokens (int or float).
    0 up to max_len - cache_len; then -(len - (max_len - cache_len)) / cache_len * factor, a linear ramp;
    -factor at or beyond max_len. Returns [B] float32.

    >>> overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, cache_len=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000, -1.0000])
    """
    check_ndim(lengths, "lengths", 1)
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = lengths.to(torch.float32)
    start = max_len - cache_len
    ramp = -(lengths - start) / cache_len * factor
    penalty = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return torch.where(lengths >= max_len, torch.full_like(ramp, -factor), penalty)
