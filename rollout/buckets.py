"""Cutting a stream of HF-named weights into size-bounded buckets that never split a decoder layer.

Why whole layers: vLLM fuses q/k/v and gate/up into one tensor and rebuilds a fused module only once all its
parts have arrived in the same reload call; a bucket holding q_proj and k_proj but not v_proj would leave the
fused module half-written (on vLLM 0.32 CPU the engine's logprobs then come out wrong). Every parameter of a decoder
layer shares the prefix up to the layer index, so grouping by that prefix keeps every fused module whole.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

from torch import Tensor

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


def bucketed(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Regroup a stream of (name, tensor) into lists of whole weight groups (see `weight_group`).

    Each yielded bucket holds at most `bucket_bytes`, except a bucket made of one group that alone is
    larger. The stream is read lazily: at most one bucket plus one group being collected are held at a
    time, so the peak is about bucket_bytes + one decoder layer, never the whole model. A group's tensors
    must arrive consecutively (HF state-dict order does this).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    bucket_size = 0
    group: list[tuple[str, Tensor]] = []
    group_size = 0
    group_key = None
    finished_groups: set[str] = set()
    for name, tensor in named_tensors:
        key = weight_group(name)
        if key != group_key:
            if group:
                if bucket and bucket_size + group_size > bucket_bytes:
                    yield bucket
                    bucket, bucket_size = [], 0
                bucket += group
                bucket_size += group_size
                finished_groups.add(group_key)
            if key in finished_groups:
                raise ValueError(
                    f"weight {name!r} belongs to group {key!r}, which already ended earlier in the stream: "
                    f"a group's tensors must be consecutive so it is never split across buckets"
                )
            group, group_size, group_key = [], 0, key
        group.append((name, tensor))
        group_size += tensor_bytes(tensor)
    if group:
        if bucket and bucket_size + group_size > bucket_bytes:
            yield bucket
            bucket = []
        bucket += group
    if bucket:
        yield bucket
