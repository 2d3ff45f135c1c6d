"""Attention functions of our own for the logprob passes, run in place of transformers' registered ones for a
call that carries one of our keyword arguments (`install_dispatch`; a model forwards them to every layer).

- native_gqa=True: transformers' sdpa, except that grouped-query attention is left to torch's kernel
  (`enable_gqa=True`) instead of copying each key/value head `num_key_value_groups` times (`repeat_kv`, which
  transformers does on CPU whenever a mask is passed).
- packed_segments: one padding-free row of segments (models.logprobs.pack_batch); segment (start, end,
  prefix_start, prefix_end) has queries [start, end) that attend to keys [prefix_start, prefix_end) in full and
  causally to [start, end); with flash_attention_2, packed_varlen (varlen_layout) comes with it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# Keyword arguments that sdpa_native_gqa does not implement: it hands such a call to transformers' own sdpa.
_DELEGATED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")

# The implementations whose registered function install_dispatch wraps (transformers calls eager directly).
PACKABLE_IMPLEMENTATIONS = ("sdpa", "flash_attention_2")


def sdpa_native_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    is_causal=None, **kwargs):
    """query [B, H, Q, D], key/value [B, Hkv, S, D], attention_mask [B, 1, Q, S] bool/additive or None.
    Returns (output [B, Q, H, D], None), as every transformers attention function does."""
    if dropout > 0 or any(kwargs.get(name) is not None for name in _DELEGATED_KWARGS) or query.shape[1] == key.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                                 else getattr(module, "is_causal", True))
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                            is_causal=causal, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def segment_attention(query, key, value, segments, scaling) -> Tensor:
    """query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, H, N, D], one sdpa call per segment."""
    outputs = []
    grouped = query.shape[1] != key.shape[1]
    for start, end, prefix_start, prefix_end in segments:
        segment_query = query[:, :, start:end]
        if prefix_end > prefix_start:
            keys = torch.cat([key[:, :, prefix_start:prefix_end], key[:, :, start:end]], dim=2)
            values = torch.cat([value[:, :, prefix_start:prefix_end], value[:, :, start:end]], dim=2)
            prefix = prefix_end - prefix_start
            # Bottom-right causal: query i sees the whole prefix and its own tokens up to i.
            allowed = torch.ones(end - start, prefix + end - start, dtype=torch.bool, device=query.device).tril(prefix)
            outputs.append(F.scaled_dot_product_attention(segment_query, keys, values, attn_mask=allowed,
                                                          scale=scaling, enable_gqa=grouped))
        else:
            outputs.append(F.scaled_dot_product_attention(segment_query, key[:, :, start:end], value[:, :, start:end],
                                                          is_causal=True, scale=scaling, enable_gqa=grouped))
    return torch.cat(outputs, dim=2)


def varlen_layout(segments, device) -> dict:
    """What flash_attn_varlen_func needs for `segments`: cumulative query and key lengths [S+1] int32, their
    maxima, and key_index [sum of key lengths] long (each segment's prefix positions, then its own)."""
    query_lengths = [end - start for start, end, _, _ in segments]
    key_lengths = [end - start + prefix_end - prefix_start for start, end, prefix_start, prefix_end in segments]
    key_index = [position for start, end, prefix_start, prefix_end in segments
                 for position in list(range(prefix_start, prefix_end)) + list(range(start, end))]
    cumulative = lambda lengths: torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
    return {"cu_seqlens_q": cumulative(query_lengths), "cu_seqlens_k": cumulative(key_lengths),
            "max_seqlen_q": max(query_lengths), "max_seqlen_k": max(key_lengths),
            "key_index": torch.tensor(key_index, dtype=torch.long, device=device)}


def flash_varlen_attention(query, key, value, layout: dict, scaling, varlen_function) -> Tensor:
    """query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, H, N, D] through `varlen_function` (flash-attn's
    flash_attn_varlen_func signature; its causal mask is aligned bottom-right when a segment has more keys than
    queries) on keys gathered per segment (`varlen_layout`)."""
    queries = query[0].transpose(0, 1)  # [N, H, D]
    keys = key[0].transpose(0, 1)[layout["key_index"]]  # [sum of key lengths, Hkv, D]
    values = value[0].transpose(0, 1)[layout["key_index"]]
    output = varlen_function(queries, keys, values, layout["cu_seqlens_q"], layout["cu_seqlens_k"],
                             layout["max_seqlen_q"], layout["max_seqlen_k"], softmax_scale=scaling, causal=True)
    return output.transpose(0, 1)[None]


def _dispatching(original):
    """`original` (a transformers attention function), except for calls that carry our keyword arguments."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        segments, varlen = kwargs.pop("packed_segments", None), kwargs.pop("packed_varlen", None)
        if varlen is not None:  # a varlen_layout, given only where flash-attn is used
            from flash_attn import flash_attn_varlen_func  # optional, CUDA only

            output = flash_varlen_attention(query, key, value, varlen, scaling, flash_attn_varlen_func)
            return output.transpose(1, 2).contiguous(), None
        if segments is not None:
            return segment_attention(query, key, value, segments, scaling).transpose(1, 2).contiguous(), None
        function = sdpa_native_gqa if kwargs.pop("native_gqa", False) else original
        return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    attention.packed_dispatch_of = original
    return attention


def install_dispatch() -> None:
    """Wrap the registered attention functions of PACKABLE_IMPLEMENTATIONS (once per process). A wrapper under the
    model's own implementation name, not a switch to another one for the call: gradient checkpointing recomputes
    the layers during backward, after any switch is undone, but replays their keyword arguments, so a call carrying
    ours runs the same function wherever it runs; every other call reaches the original."""
    for name in PACKABLE_IMPLEMENTATIONS:
        function = AttentionInterface._global_mapping.get(name)
        if function is not None and not hasattr(function, "packed_dispatch_of"):
            AttentionInterface.register(name, _dispatching(function))
