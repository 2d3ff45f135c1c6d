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


def prefix_attention_available(device: torch.device) -> bool:
    """Whether SharedPrefixCache can attend on this device: it needs torch's CPU flash-attention kernel, which
    returns the log-sum-exp that merging two partial attentions takes."""
    if device.type != "cpu":
        return False
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (AttributeError, RuntimeError):
        return False
    return True


class PromptLayer(CacheLayerMixin):
    """One layer of a SharedPrefixCache: the prompts' keys and values once ([P, heads, Lp, head_dim], set by
    the prefill through `update`), and each row's completion keys and values ([rows, heads, capacity,
    head_dim], filled left to right by `SharedPrefixCache.attend`)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0  # completion columns filled

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = key_states, value_states
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The prefill: keep the prompts' keys and values [P, heads, Lp, head_dim]; returns them."""
        if self.is_initialized:
            raise ValueError("SharedPrefixCache takes one prefill; decode steps go through attend()")
        self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return (self.keys.shape[-2] if self.is_initialized else 0) + self.length

    def get_max_length(self) -> int:
        return -1

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep completion rows `indices`; the prompts' keys and values are every row's and stay."""
        if self.length:
            self.completion_keys = self.completion_keys[indices]
            self.completion_values = self.completion_values[indices]


class SharedPrefixCache(Cache):
    """A KV cache for n completions per prompt that holds each prompt's keys and values once.

    Why: GRPO decodes G rows per prompt, and a decode step reads every cached key and value of every row.
    With the prompt copied to each of its G rows (PreallocatedLayer), 16 rows of 200-token prompts read
    16 x (200 + t) keys per layer and step; here 4 x 200 + 16 x t. Each new token attends to its prompt's keys
    and to its own row's completion keys in two calls of torch's CPU flash-attention kernel, and the two
    partial results are merged by their log-sum-exp: softmax over the union of the keys, up to float rounding
    (~1e-7). The time per layer it saves is in bench/README.md ("Decode-step profile").

    Rows are numbered as the engine lays them out, prompt i's n rows at i*n .. i*n+n-1; `batch_select_indices`
    drops rows that finished (their completion keys go; the prompt's stay while any row needs them).
    """

    def __init__(self, num_layers: int, capacity: int, n: int, prompt_mask: torch.Tensor):
        """capacity: completion tokens per row; prompt_mask: [P, 1, 1, Lp] additive float (0 on real prompt
        columns, -inf on left padding), the mask of the prefix part."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 token, got {capacity}")
        super().__init__(layers=[PromptLayer(capacity) for _ in range(num_layers)])
        self.n = n
        self.prompt_mask = prompt_mask
        self.rows = torch.arange(prompt_mask.shape[0] * n, device=prompt_mask.device)  # live row -> layout row

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = self.rows[indices]
        super().batch_select_indices(indices)

    def attend(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Append the new token's key/value [A, kv_heads, 1, head_dim] to layer `index` and return the
        attention output of its query [A, heads, 1, head_dim] as [A, heads * head_dim] (heads in order:
        query head h reads key/value head h // (heads / kv_heads), as transformers' repeat_kv)."""
        layer = self.layers[index]
        rows, kv_heads, head_dim = query.shape[0], key.shape[1], query.shape[-1]
        group = query.shape[1] // kv_heads
        if layer.length == 0:
            layer.completion_keys = key.new_empty(rows, kv_heads, layer.capacity, head_dim)
            layer.completion_values = value.new_empty(rows, kv_heads, layer.capacity, head_dim)
        if layer.length >= layer.capacity:
            raise ValueError(f"KV cache overflow: {layer.length + 1} completion tokens in a cache allocated for "
                             f"{layer.capacity}")
        layer.completion_keys[:, :, layer.length] = key[:, :, 0]
        layer.completion_values[:, :, layer.length] = value[:, :, 0]
        layer.length += 1
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        # A kv head's query heads act as `group` query positions: [A, kv_heads, group, head_dim].
        query = query.reshape(rows, kv_heads, group, head_dim)
        own, own_lse = flash(query, layer.completion_keys[:, :, : layer.length],
                             layer.completion_values[:, :, : layer.length], scale=scale)
        # The prefix part: each prompt's n rows (finished rows as zeros) as n * group query positions.
        prompts, n = self.prompt_mask.shape[0], self.n
        laid_out = query if rows == prompts * n else query.new_zeros(prompts * n, kv_heads, group, head_dim).index_copy_(
            0, self.rows, query)
        laid_out = laid_out.view(prompts, n, kv_heads, group, head_dim).transpose(1, 2).reshape(
            prompts, kv_heads, n * group, head_dim)
        prefix, prefix_lse = flash(laid_out, layer.keys, layer.values, attn_mask=self.prompt_mask, scale=scale)
        prefix = prefix.view(prompts, kv_heads, n, group, head_dim).transpose(1, 2).reshape(prompts * n, kv_heads, group, head_dim)
        prefix_lse = prefix_lse.view(prompts, kv_heads, n, group).transpose(1, 2).reshape(prompts * n, kv_heads, group)
        if rows != prompts * n:
            prefix, prefix_lse = prefix[self.rows], prefix_lse[self.rows]
        # The prefix part's share of the softmax mass: exp(prefix_lse) / (exp(prefix_lse) + exp(own_lse)).
        share = torch.sigmoid(prefix_lse - own_lse)[..., None].to(query.dtype)
        return torch.lerp(own, prefix, share).reshape(rows, -1)
