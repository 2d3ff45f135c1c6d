"""Weight sync from the trainer to the rollout engine after an optimizer step: stream full tensors out of
the (possibly FSDP2-sharded) policy and load them into the engine in size-bounded buckets, so the full model
is never materialised at once on top of the sharded one.

Every rank must call `sync_weights` at the same point: gathering a sharded tensor is a collective.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from models.lora import merged_state_dict
from rollout.buckets import bucketed, tensor_bytes

DEFAULT_BUCKET_BYTES = 1 << 30


@contextmanager
def updating_weights(engine):
    """The engine's order for a weight update (launch.plan.engine_cycle), around the loads in the block: its
    weights' memory back (a vLLM asleep at level 2 holds none), the new weights in, this process's cached blocks
    and the gathered buckets released, and only then the KV cache, so the buckets never sit on top of a full KV
    cache."""
    engine.wake(("weights",))
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake(("kv_cache",))


def sync_weights(model, engine, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Push the policy's current weights into `engine` (an `rollout.engine.Engine`).

    model:        the policy (plain or FSDP2-sharded) whose weights the engine should sample with; with LoRA
                  adapters the engine gets the merged weights W + scale * B @ A under the base names.
    bucket_bytes: the most bytes of full tensors handed to the engine per `update_weights` call (a decoder
                  layer is never split, so a bucket exceeds this only when one layer alone does). Larger
                  buckets mean fewer engine calls (the per-call overhead dominates small syncs); smaller
                  buckets bound the extra memory the sync needs.
    Returns metrics: sync/seconds (wall time, including the gathers), sync/load_seconds (inside the
    engine), sync/bytes (full tensors streamed), sync/buckets, sync/max_bucket_bytes.
    """
    start = time.perf_counter()
    load_seconds = 0.0
    total_bytes = 0
    buckets = 0
    max_bucket_bytes = 0
    with updating_weights(engine):
        for bucket in bucketed(merged_state_dict(model), bucket_bytes):
            size = sum(tensor_bytes(tensor) for _, tensor in bucket)
            total_bytes += size
            max_bucket_bytes = max(max_bucket_bytes, size)
            buckets += 1
            load_start = time.perf_counter()
            engine.update_weights(bucket)
            load_seconds += time.perf_counter() - load_start
            del bucket  # drop the gathered tensors before the next bucket is gathered
        if dist.is_available() and dist.is_initialized():
            # Every replica holds the new weights before any rank starts the next rollout; this also makes
            # sync/seconds the slowest rank's time rather than the first to finish.
            dist.barrier()
    return {
        "sync/seconds": time.perf_counter() - start,
        "sync/load_seconds": load_seconds,
        "sync/bytes": float(total_bytes),
        "sync/buckets": float(buckets),
        "sync/max_bucket_bytes": float(max_bucket_bytes),
    }
