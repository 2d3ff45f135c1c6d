"""One decoding step of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) written out as plain tensor
operations on the model's own modules, for the transformers engine.

Why: a decode step moves one token per row through every layer, so the model is mostly small operations, and
transformers' generic forward (output capturing, mask construction, keyword plumbing, its cache protocol) is a
visible share of a step (measured in bench/README.md, "Decode-step profile"). This step calls the same
modules (norms, rotary embedding, activation) in the same order; with module weights (`weights=None`) its
hidden states equal the model's forward bit for bit (tests/test_rollout_hf.py checks the tokens and logprobs).
Any other architecture, or a sliding-window configuration, uses the model's forward instead.

On CPU the projections run on `DecodeWeights`: q/k/v concatenated into one matrix and gate/up into another
(4 products per layer instead of 7), each reordered once per `generate` call into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the kernels torch.compile's CPU backend uses for frozen
weights). A product of a few rows by a weight read from memory is what a decode step is made of, and oneDNN's
blocked layout runs such few-row products faster than MKL's sgemm on the [out, in] layout of nn.Linear. The
values differ from nn.Linear's by float rounding only (oneDNN sums in another order: ~1e-6 relative). The
reordered copy costs one more copy of the weights while generating.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rollout.kv_cache import SharedPrefixCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "input_layernorm", "post_attention_layernorm")


def supports_decode_step(model: torch.nn.Module) -> bool:
    """True when `decode_step` computes exactly what `model`'s forward computes."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES or not hasattr(model, "get_decoder"):
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    decoder = model.get_decoder()
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    return all(_has(layer, part) for layer in decoder.layers for part in _LAYER_PARTS)


def _has(module: torch.nn.Module, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def _rotate(states: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, as transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin."""
    half = states.shape[-1] // 2
    return states * cos + torch.cat((-states[..., half:], states[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class LayerWeights:
    """One layer's projections for decoding, each a oneDNN-reordered [out, in] weight with its bias or None.

    qkv: q, k and v stacked ([q_size + 2 * kv_size, H]); gate_up: gate and up stacked ([2 * I, H])."""
    qkv: Tensor
    qkv_bias: Tensor | None
    q_size: int
    kv_size: int
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None


@dataclass(frozen=True)
class DecodeWeights:
    """Every layer's projections and the output head (head: reordered [V, H]), for `decode_step` and the
    engine's head projection (`linear`). Valid for the weights they were made from: the engine makes them
    anew in every `generate`."""
    layers: tuple[LayerWeights, ...]
    head: Tensor
    head_bias: Tensor | None


def onednn_available(weight: Tensor) -> bool:
    """Whether `pack_decode_weights` can reorder this weight: a float32 or bfloat16 CPU tensor and a torch
    build with oneDNN's linear kernels."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    return True


def _stacked(linears: list[torch.nn.Linear], rows: int) -> tuple[Tensor, Tensor | None]:
    weight = torch.cat([linear.weight.detach() for linear in linears]) if len(linears) > 1 else linears[0].weight.detach()
    biases = [linear.bias for linear in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(linear.out_features)
                          for b, linear in zip(biases, linears)])
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows), bias


def pack_decode_weights(decoder: torch.nn.Module, head: torch.nn.Linear, rows: int) -> DecodeWeights | None:
    """The decoder's projections and the head, stacked and reordered for `rows`-row products (a hint to
    oneDNN; any row count runs). None when oneDNN cannot run them, or when a projection is not a plain
    nn.Linear (a LoRA-wrapped layer computes more than its weight): decode_step then calls the modules."""
    parts = [getattr(layer.self_attn, name) for layer in decoder.layers for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    parts += [getattr(layer.mlp, name) for layer in decoder.layers for name in ("gate_proj", "up_proj", "down_proj")]
    if any(type(part) is not torch.nn.Linear for part in parts + [head]) or not onednn_available(head.weight):
        return None
    layers = []
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _stacked([attention.q_proj, attention.k_proj, attention.v_proj], rows)
        o, o_bias = _stacked([attention.o_proj], rows)
        gate_up, gate_up_bias = _stacked([mlp.gate_proj, mlp.up_proj], rows)
        down, down_bias = _stacked([mlp.down_proj], rows)
        layers.append(LayerWeights(qkv, qkv_bias, attention.q_proj.out_features, attention.k_proj.out_features,
                                   o, o_bias, gate_up, gate_up_bias, down, down_bias))
    head_weight, head_bias = _stacked([head], rows)
    return DecodeWeights(tuple(layers), head_weight, head_bias)


def linear(inputs: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """inputs [A, in] @ weight.T (+ bias) -> [A, out], weight as `pack_decode_weights` reordered it."""
    return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")


def decode_step(decoder: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                cache, weights: DecodeWeights | None = None) -> Tensor:
    """Run one new token per row through `decoder` on `cache` and return its final hidden states.

    input_ids:      [A, 1] long, the token each row feeds.
    attention_mask: [A, 1, 1, S] additive float (0 on real columns, -inf on padding), S = cached tokens + 1;
                    None with a SharedPrefixCache, which holds its prompts' mask.
    position_ids:   [A, 1] long.
    cache:          a rollout.kv_cache cache: preallocated (its layers' `update` appends the step's keys and
                    values, then one sdpa call attends) or a SharedPrefixCache (its `attend` does both).
    weights:        the projections as `pack_decode_weights` made them; None calls the layers' modules.
    Returns [A, H] float, the normed hidden state from which the head predicts the next token.
    """
    rows = input_ids.shape[0]
    hidden = decoder.embed_tokens(input_ids)  # [A, 1, H]
    cos, sin = decoder.rotary_emb(hidden, position_ids)
    cos, sin = cos[:, None], sin[:, None]  # [A, 1 (heads), 1, head_dim]
    for index, layer in enumerate(decoder.layers):
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        shape = (rows, 1, -1, attention.head_dim)
        if weights is None:
            query, key, value = attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
        else:
            packed = weights.layers[index]
            query, key, value = linear(normed[:, 0], packed.qkv, packed.qkv_bias).split(
                [packed.q_size, packed.kv_size, packed.kv_size], dim=-1)
        query, key, value = query.reshape(shape), key.reshape(shape), value.reshape(shape)
        if hasattr(attention, "q_norm"):  # Qwen3 normalises each head before the rotation
            query, key = attention.q_norm(query), attention.k_norm(key)
            query, key = _rotate(query.transpose(1, 2), cos, sin), _rotate(key.transpose(1, 2), cos, sin)
        else:  # one rotation of the query and key heads together
            query, key = _rotate(torch.cat([query, key], dim=2).transpose(1, 2), cos, sin).split(
                [query.shape[2], key.shape[2]], dim=1)
        if isinstance(cache, SharedPrefixCache):
            output = cache.attend(index, query, key, value.transpose(1, 2), attention.scaling)
        else:
            key, value = cache.layers[index].update(key, value.transpose(1, 2))
            output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                    scale=attention.scaling, enable_gqa=query.shape[1] != key.shape[1])
            output = output.transpose(1, 2).reshape(rows, -1)
        if weights is None:
            hidden = hidden + attention.o_proj(output[:, None])
        else:
            hidden = hidden + linear(output, packed.o, packed.o_bias)[:, None]
        normed = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        if weights is None:
            hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        else:
            gate, up = linear(normed[:, 0], packed.gate_up, packed.gate_up_bias).chunk(2, dim=-1)
            hidden = hidden + linear(mlp.act_fn(gate) * up, packed.down, packed.down_bias)[:, None]
    return decoder.norm(hidden)[:, -1, :]
