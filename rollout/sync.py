"""Weight sync from the trainer to the rollout engine after an optimizer step: stream full tensors out of
the (possibly FSDP2-sharded) policy and load them into the engine in size-bounded buckets, so the full model
is never materialised at once on top of the sharded one.

Every rank must call `sync_weights` at the same point: gathering a sharded tensor is a collective.

A bucket never splits a decoder layer (`weight_group`): vLLM rebuilds a fused q/k/v or gate/up module only from
parts loaded in the same reload call, and a half-written one gives wrong logprobs (vLLM 0.32 CPU).
"""
from __future__ import annotations

import itertools
import re
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from models.lora import merged_state_dict

DEFAULT_BUCKET_BYTES = 1 << 30
# "model.layers.12.self_attn.q_proj.weight" -> "model.layers.12."; the first dotted integer ends the prefix.
_LAYER_PREFIX = re.compile(r"^(.*?\.\d+\.)")


def weight_group(name: str) -> str:
    """The unit a weight must be loaded with: its decoder layer ("model.layers.12."), else its module
    ("model.embed_tokens", "model.norm", "lm_head").

    >>> weight_group("model.layers.12.self_attn.q_proj.weight"), weight_group("model.norm.weight")
    ('model.layers.12.', 'model.norm')
    """
    match = _LAYER_PREFIX.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def tensor_bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketed(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Regroup a stream of (name, tensor) into lists of whole weight groups (see `weight_group`).

    Each yielded bucket holds at most `bucket_bytes`, except a bucket made of one group that alone is
    larger. The stream is read lazily: at most one bucket plus one group being collected are held at a
    time, so the peak is about bucket_bytes + one decoder layer, never the whole model. A group's tensors
    must arrive consecutively (HF state-dict order does this).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket, bucket_size, finished_groups = [], 0, set()
    for key, tensors in itertools.groupby(named_tensors, key=lambda named: weight_group(named[0])):
        group = list(tensors)
        if key in finished_groups:
            raise ValueError(
                f"weight {group[0][0]!r} belongs to group {key!r}, which already ended earlier in the stream: "
                f"a group's tensors must be consecutive so it is never split across buckets"
            )
        finished_groups.add(key)
        group_size = sum(tensor_bytes(tensor) for _, tensor in group)
        if bucket and bucket_size + group_size > bucket_bytes:
            yield bucket
            bucket, bucket_size = [], 0
        bucket += group
        bucket_size += group_size
    if bucket:
        yield bucket


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
    start, load_seconds, sizes = time.perf_counter(), 0.0, []
    with updating_weights(engine):
        for bucket in bucketed(merged_state_dict(model), bucket_bytes):
            sizes.append(sum(tensor_bytes(tensor) for _, tensor in bucket))
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
        "sync/bytes": float(sum(sizes)),
        "sync/buckets": float(len(sizes)),
        "sync/max_bucket_bytes": float(max(sizes, default=0)),
    }
