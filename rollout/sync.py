"""Weight sync from the trainer to the rollout engine after an optimizer step: full tensors streamed out of the
(possibly FSDP2-sharded) policy into the engine in size-bounded buckets, so the full model is never materialised
on top of the sharded one. Every rank calls `sync_weights` at the same point: gathering a sharded tensor is a
collective. A bucket never splits a decoder layer (`weight_group`): vLLM rebuilds a fused q/k/v or gate/up module
only from parts loaded in the same reload call, and a half-written one gives wrong logprobs (vLLM 0.32 CPU)."""
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

_LAYER_PREFIX = re.compile(r"^(.*?\.\d+\.)")


def weight_group(name: str) -> str:
    """The unit a weight must be loaded with: its decoder layer ("model.layers.12."), else its module
    ("model.embed_tokens", "model.norm", "lm_head").

    >>> weight_group("model.layers.12.self_attn.q_proj.weight"), weight_group("model.norm.weight")
    ('model.layers.12.', 'model.norm')
    """
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def tensor_bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketed(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Regroup a stream of (name, tensor) into lists of whole weight groups, each list at most `bucket_bytes` unless
    one group alone is larger. Read lazily, so at most one bucket and one group are held (about bucket_bytes + one
    decoder layer). A group's tensors must arrive consecutively, as in HF state-dict order."""
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
    """The engine's order around the loads in the block (launch.plan.engine_cycle): its weights' memory back (a vLLM
    asleep at level 2 holds none), the loads, this process's cached blocks released, and only then the KV cache,
    so the gathered buckets never sit on top of a full KV cache."""
    engine.wake(("weights",))
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.wake(("kv_cache",))


def sync_weights(model, engine, *, bucket_bytes: int, dtype: torch.dtype | None = None) -> dict[str, float]:
    """Push the policy's current weights, LoRA adapters merged, into `engine` in `update_weights` calls of about
    `bucket_bytes` (larger: fewer calls; smaller: less extra memory), gathered in the engine's `dtype` (None: as
    stored; the engine would cast them to its own on load anyway). Returns the sync/* metrics below."""
    start, load_seconds, sizes = time.perf_counter(), 0.0, []
    with updating_weights(engine):
        for bucket in bucketed(merged_state_dict(model, dtype), bucket_bytes):
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
