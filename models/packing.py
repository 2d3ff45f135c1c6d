"""Padding-free logprob passes: a micro-batch's sequences packed into one row, each distinct prompt once and
its completions after it, every token at its own position; attention runs per segment (a prompt, or a
completion that also sees its prompt's keys), so no token attends to another sequence and no pad is computed.

How packing and prompt sharing combine (decided here, measured in bench/packed.py): a prompt that G rows share
is packed once, followed by its G completions; a completion attends to its prompt's keys (all of them) and
causally to its own tokens, so the forward covers U*Lp + sum(T_b) tokens (U distinct prompts) instead of the
padded B*(Lp+T). A prompt that no other row shares is packed with its completion as one causal segment.
The last token of a completion is only a label (nothing is predicted from it), so it is not packed.

Segments are (start, end, prefix_start, prefix_end) in packed positions: queries [start, end) attend to keys
[prefix_start, prefix_end) in full and causally to [start, end). Kernels: one torch sdpa call per segment; for
a model loaded with flash_attention_2 (CUDA, bf16/fp16: models.loading.choose_attention), one
flash_attn_varlen_func call over keys gathered per segment (its causal mask is aligned bottom-right when a
segment has more keys than queries).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models.attention import SDPA_NATIVE_GQA


@dataclass(frozen=True)
class PackedBatch:
    """A pad_batch micro-batch as one packed row.

    input_ids, position_ids: [1, N] long (positions restart at 0 for each prompt; a completion continues
                             from its prompt's length, as pad_batch numbers it).
    segments:      tuple of (start, end, prefix_start, prefix_end), tiling [0, N) in order.
    predict_index: [M] long, the packed position whose final hidden state predicts each completion token,
                   for the M real completion tokens in row-major order of completion_mask.
    labels:        [M] long, those completion tokens.
    """

    input_ids: Tensor
    position_ids: Tensor
    segments: tuple[tuple[int, int, int, int], ...]
    predict_index: Tensor
    labels: Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_batch(batch: dict, prompt_index: Tensor | None = None) -> PackedBatch:
    """Pack the dict of models.batching.pad_batch (B rows, prompt_len Lp, T completion columns).

    prompt_index: [B] long, row b's distinct prompt (models.logprobs.prompt_groups); rows with the same index
                  share one packed prompt. None: every row its own prompt.
    Raises ValueError if a completion_mask row is not ones followed by zeros (pad_batch's layout).
    """
    input_ids, attention_mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
    completion_mask, prompt_len = batch["completion_mask"].cpu() > 0, int(batch["prompt_len"])
    batch_size = input_ids.shape[0]
    prompt_lengths = attention_mask[:, :prompt_len].sum(dim=1).tolist()
    completion_lengths = completion_mask.sum(dim=1).tolist()
    for row, length in enumerate(completion_lengths):
        if not bool(completion_mask[row, :length].all()):
            raise ValueError(f"completion_mask row {row} is not {length} ones followed by zeros: not a pad_batch layout")
    if prompt_index is None:
        prompt_index = torch.arange(batch_size)
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompt_index.tolist()):
        groups.setdefault(prompt, []).append(row)
    ids, positions, segments, predict = [], [], [], [None] * batch_size
    cursor = 0

    def append(tokens: list[int], first_position: int) -> None:
        nonlocal cursor
        ids.extend(tokens)
        positions.extend(range(first_position, first_position + len(tokens)))
        cursor += len(tokens)

    for rows in groups.values():  # prompts in order of first appearance
        prompt_length = prompt_lengths[rows[0]]
        prompt = input_ids[rows[0], prompt_len - prompt_length : prompt_len].tolist()
        start = cursor
        if len(rows) == 1:  # nothing to share: prompt and completion as one causal segment
            row = rows[0]
            append(prompt + input_ids[row, prompt_len : prompt_len + completion_lengths[row] - 1].tolist(), 0)
            segments.append((start, cursor, start, start))
            predict[row] = list(range(start + prompt_length - 1, start + prompt_length - 1 + completion_lengths[row]))
            continue
        append(prompt, 0)
        segments.append((start, cursor, start, start))
        for row in rows:
            length = completion_lengths[row]
            completion_start = cursor
            if length > 1:
                append(input_ids[row, prompt_len : prompt_len + length - 1].tolist(), prompt_length)
                segments.append((completion_start, cursor, start, start + prompt_length))
            # Token 0 is predicted from the prompt's last position, token t > 0 from completion token t - 1.
            predict[row] = [start + prompt_length - 1] + list(range(completion_start, completion_start + length - 1))
            predict[row] = predict[row][:length]
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long), position_ids=torch.tensor([positions], dtype=torch.long),
        segments=tuple(segments), predict_index=torch.tensor([p for row in predict for p in row], dtype=torch.long),
        labels=input_ids[:, prompt_len:][completion_mask])


def segment_mask(segments, num_tokens: int, device=None) -> Tensor:
    """The same attention pattern as one [1, 1, N, N] bool mask (True = attend): the block-diagonal
    alternative to per-segment attention, and the reference the tests compare it with."""
    mask = torch.zeros(num_tokens, num_tokens, dtype=torch.bool, device=device)
    for start, end, prefix_start, prefix_end in segments:
        mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool, device=device).tril()
        mask[start:end, prefix_start:prefix_end] = True
    return mask[None, None]


def _segment_attention(query, key, value, segments, scaling) -> Tensor:
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
            allowed = torch.ones(end - start, prefix + end - start, dtype=torch.bool, device=query.device)
            allowed = allowed.tril(diagonal=prefix)
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
    flash_attn_varlen_func signature) on keys gathered per segment (`varlen_layout`)."""
    queries = query[0].transpose(0, 1)  # [N, H, D]
    keys = key[0].transpose(0, 1)[layout["key_index"]]  # [sum of key lengths, Hkv, D]
    values = value[0].transpose(0, 1)[layout["key_index"]]
    output = varlen_function(queries, keys, values, layout["cu_seqlens_q"], layout["cu_seqlens_k"],
                             layout["max_seqlen_q"], layout["max_seqlen_k"], softmax_scale=scaling, causal=True)
    return output.transpose(0, 1)[None]


def packed_attention(module, query, key, value, packed_segments, packed_varlen=None, scaling=None) -> Tensor:
    """Attention of one packed row (see the module docstring): query [1, H, N, D], key/value [1, Hkv, N, D]
    -> [1, N, H, D]. packed_varlen: a varlen_layout, given only where flash-attn is used."""
    if query.shape[0] != 1:
        raise ValueError(f"a packed pass holds one row; got query of shape {tuple(query.shape)}")
    if packed_varlen is not None:
        from flash_attn import flash_attn_varlen_func

        output = flash_varlen_attention(query, key, value, packed_varlen, scaling, flash_attn_varlen_func)
    else:
        output = _segment_attention(query, key, value, packed_segments, scaling)
    return output.transpose(1, 2).contiguous()


# The implementations whose registered function is wrapped to run packed passes (eager has no registered
# function to wrap: transformers calls each model file's own eager function directly).
PACKABLE_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", SDPA_NATIVE_GQA)


def _dispatching(original):
    """`original` (a transformers attention function), except for calls that carry packed_segments."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        segments, varlen = kwargs.pop("packed_segments", None), kwargs.pop("packed_varlen", None)
        if segments is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return packed_attention(module, query, key, value, segments, varlen, scaling), None

    attention.packed_dispatch_of = original
    return attention


def install_packed_dispatch() -> None:
    """Wrap the registered attention functions of PACKABLE_IMPLEMENTATIONS (once per process).

    Why a wrapper under the model's own implementation name rather than switching the model to a packed one
    for the call: under gradient checkpointing the layers are recomputed during backward, after any switch
    is undone, and they must run packed attention again. The checkpoint replays each layer's keyword arguments,
    so a call carrying packed_segments is packed wherever it runs; every other call reaches the original.
    """
    from transformers import AttentionInterface

    from models.attention import register_ours

    register_ours()
    for name in PACKABLE_IMPLEMENTATIONS:
        function = AttentionInterface._global_mapping.get(name)
        if function is not None and not hasattr(function, "packed_dispatch_of"):
            AttentionInterface.register(name, _dispatching(function))
