"""Mixed precision in one process: fp32 master weights (what AdamW steps), matrix products in bf16.

Under torchrun FSDP2's MixedPrecisionPolicy gives the policy this precision (parameters gathered in the compute
dtype, gradients reduced in fp32: models.fsdp.shard). One process has no FSDP, so the model's forward runs under
torch.autocast instead: products (linear, matmul, attention) in the compute dtype, the residual stream, norms and
softmaxes in fp32, gradients into the fp32 parameters. The same policy by a lighter mechanism (launch/plan.py
names it per path), as transformers' Trainer does with bf16=True.
"""
from __future__ import annotations

import functools

import torch


def compute_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Run `model`'s forward (and so its backward) under autocast to `dtype`; the parameters keep their dtype.
    Returns the model. Gradient checkpointing replays the autocast state of the forward it recomputes."""
    if dtype == torch.float32 or getattr(model, "compute_dtype", None) == dtype:
        return model
    device_type = next(model.parameters()).device.type
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward
    model.compute_dtype = dtype
    return model
