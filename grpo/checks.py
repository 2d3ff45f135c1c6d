"""Argument checks shared by the math in grpo/: each raises ValueError naming the argument and the shapes."""
from __future__ import annotations

from torch import Tensor


def check_ndim(tensor: Tensor, name: str, ndim: int) -> None:
    if not hasattr(tensor, "ndim"):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(tensor.shape)}")


def check_same_shape(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{a_name} has shape {tuple(a.shape)} but {b_name} has shape {tuple(b.shape)}")


def check_floating(tensor: Tensor, name: str) -> None:
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")


def check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(choices)}")


def check_groups(num: int, group_size: int) -> int:
    """Number of groups P for `num` = P * group_size sequences."""
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (a group needs a baseline), got {group_size}")
    if num % group_size != 0:
        raise ValueError(f"batch of {num} rewards is not divisible by group_size {group_size}")
    return num // group_size
