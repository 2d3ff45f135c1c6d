"""DAPO's dynamic sampling filter: drop groups that carry no learning signal."""
from __future__ import annotations

from torch import Tensor

from grpo.checks import check_groups, check_ndim


def keep_groups(metric: Tensor, group_size: int) -> Tensor:
    """Keep a group only if its metric is not constant within it (Yu et al. 2025, DAPO, section 3.2).

    metric: [B] per-completion value to test, B = P * G (correctness by default, not the shaped reward:
            a length penalty makes an all-correct group look informative when it is not).
    Returns BoolTensor [P].

    >>> import torch
    >>> keep_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    tensor([False,  True, False])
    """
    check_ndim(metric, "metric", 1)
    check_groups(metric.shape[0], group_size)
    grouped = metric.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
