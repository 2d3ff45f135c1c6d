"""DAPO's dynamic sampling filter: drop groups that carry no learning signal."""
from __future__ import annotations

from torch import Tensor

from grpo.advantages import flat_groups


def keep_groups(metric: Tensor, group_size: int) -> Tensor:
    """Keep a group only if its metric is not constant within it (Yu et al. 2025, DAPO, section 3.2).

    metric: [B] per-completion value to test, B = P * G (correctness by default, not the shaped reward:
            a length penalty makes an all-correct group look informative when it is not).
    Returns BoolTensor [P].

    >>> import torch
    >>> keep_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    tensor([False,  True, False])
    """
    return ~flat_groups(metric, group_size)
