"""Mixed precision in one process: fp32 master weights (what AdamW steps), matrix products in bf16.

Under torchrun FSDP2's MixedPrecisionPolicy gives this precision (models.fsdp.shard). One process has no FSDP, so
the model's forward runs under torch.autocast instead, as transformers' Trainer does with bf16=True: products
(linear, matmul, attention) in the compute dtype; the residual stream, norms, softmaxes and gradients in fp32."""
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
