"""One decoding step of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) written out as plain tensor
operations on the model's own modules, for the transformers engine.

Why: a decode step moves one token per row through every layer, so the model is mostly small operations;
transformers' generic forward (output capturing, mask construction, keyword plumbing, its cache protocol) adds
about 20 ms to a 140 ms step of SmolLM2-135M at 16 rows on the 2-core CPU. This step calls the same
modules (projections, norms, rotary embedding, activation) in the same order with the same kernels, so its
hidden states equal the model's forward bit for bit (tests/test_rollout_hf.py checks the tokens and logprobs).
Any other architecture, or a sliding-window configuration, uses the model's forward instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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


def decode_step(decoder: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                cache) -> Tensor:
    """Run one new token per row through `decoder` on `cache` and return its final hidden states.

    input_ids:      [A, 1] long, the token each row feeds.
    attention_mask: [A, 1, 1, S] additive float (0 on real columns, -inf on padding), S = cached tokens + 1.
    position_ids:   [A, 1] long.
    cache:          rollout.kv_cache cache (its layers' `update` appends the step's keys and values).
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
        query = attention.q_proj(normed).view(shape)
        key = attention.k_proj(normed).view(shape)
        if hasattr(attention, "q_norm"):  # Qwen3 normalises each head before the rotation
            query, key = attention.q_norm(query), attention.k_norm(key)
        query = _rotate(query.transpose(1, 2), cos, sin)
        key = _rotate(key.transpose(1, 2), cos, sin)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        key, value = cache.layers[index].update(key, value)
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=attention.scaling,
                                                enable_gqa=query.shape[1] != key.shape[1])
        hidden = hidden + attention.o_proj(output.transpose(1, 2).reshape(rows, 1, -1))
        normed = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))
    return decoder.norm(hidden)[:, -1, :]
