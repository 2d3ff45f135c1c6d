"""A KV cache allocated once per `generate` call at its final length, for the transformers engine.

transformers' DynamicCache grows by `torch.cat` at every token, copying every layer's whole cache each step;
this one writes the new token's keys and values into a buffer of the final size and hands attention a view of
the filled part, so a decode step copies nothing but the new entries. It implements the small part of
transformers' Cache protocol that decoder models call (`update`, lengths for the mask, row selection).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    """One layer's keys and values, [rows, heads, capacity, head_dim], filled left to right.

    All rows share one length (the engine's rows are left-padded to a common column), so a decode step
    appends one column for every row.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads, _, key_dim = key_states.shape
        self.keys = key_states.new_empty(rows, heads, self.capacity, key_dim)
        self.values = value_states.new_empty(rows, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key/value_states [rows, heads, Q, head_dim] after the filled columns; return views of all of
        them [rows, heads, length + Q, head_dim]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new_length = self.length + key_states.shape[-2]
        if new_length > self.capacity:
            raise ValueError(f"KV cache overflow: {new_length} tokens in a cache allocated for {self.capacity}")
        self.keys[:, :, self.length:new_length] = key_states
        self.values[:, :, self.length:new_length] = value_states
        self.length = new_length
        return self.keys[:, :, :new_length], self.values[:, :, :new_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (in that order; repeats allowed): copies the filled columns only."""
        if self.is_initialized:
            keys, values = self.keys[indices, :, : self.length], self.values[indices, :, : self.length]
            self.keys = keys.new_empty(len(indices), keys.shape[1], self.capacity, keys.shape[-1])
            self.values = values.new_empty(len(indices), values.shape[1], self.capacity, values.shape[-1])
            self.keys[:, :, : self.length] = keys
            self.values[:, :, : self.length] = values


def preallocated_cache(num_layers: int, capacity: int) -> Cache:
    """A transformers Cache of `num_layers` PreallocatedLayer, each holding up to `capacity` tokens per row."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 token, got {capacity}")
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])
