"""An attention function of our own, registered with transformers' AttentionInterface, and a context manager
that switches a model to it for the duration of a call (the engine's generate) and back, so the model object
the trainer holds is never left changed. (Packed passes wrap the registered functions instead:
models.packing.install_packed_dispatch says why.)

`sdpa_native_gqa`: transformers' sdpa path, except that grouped-query attention (fewer key/value heads than
query heads) is left to torch's kernel (`enable_gqa=True`) instead of copying every key and value head
`num_key_value_groups` times (transformers' `repeat_kv`, which it does on CPU whenever a mask is passed).
During decoding that copy is of the whole KV cache, in every layer, at every token, so it dominates a CPU
decode step of a model with few key/value heads (SmolLM2-135M: 9 query heads, 3 key/value heads); the
measured step times are in bench/README.md ("Decode-step profile").
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

SDPA_NATIVE_GQA = "nanogrpo_sdpa_native_gqa"

# Keyword arguments that change what attention computes and that this function does not implement: with any of
# them set it hands the call to transformers' own sdpa function (which handles or rejects them).
_DELEGATED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks", "position_bias")


def sdpa_native_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    is_causal=None, **kwargs):
    """query [B, H, Q, D], key/value [B, Hkv, S, D], attention_mask [B, 1, Q, S] bool/additive or None.
    Returns (output [B, Q, H, D], None), as every transformers attention function does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dropout > 0 or any(kwargs.get(name) is not None for name in _DELEGATED_KWARGS) or query.shape[1] == key.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = query.shape[2] > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                                 else getattr(module, "is_causal", True))
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                            is_causal=causal, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def register_ours() -> None:
    """Make SDPA_NATIVE_GQA known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if SDPA_NATIVE_GQA not in AttentionInterface._global_mapping:
        AttentionInterface.register(SDPA_NATIVE_GQA, sdpa_native_gqa)
        # The same masks as "sdpa" (transformers builds none for a name it does not know).
        ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_NATIVE_GQA, sdpa_mask)


def _configs(model: torch.nn.Module) -> list:
    """Every distinct config object among the model's modules (a multimodal model has one per sub-model)."""
    seen, configs = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen.add(id(config))
            configs.append(config)
    return configs


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str | None):
    """Run the body with every attention layer of `model` dispatching to the registered function `name`
    (None: leave the model as it is), then restore each config's own setting, also on an error.

    transformers looks the function up by `config._attn_implementation` at every forward, so the switch costs
    nothing and autograd graphs recorded inside keep their functions for the backward pass.
    """
    if name is None:
        yield
        return
    register_ours()
    configs = _configs(model)
    if not configs:
        raise ValueError(f"{type(model).__name__} has no transformers config with an attention implementation to switch")
    saved = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = name
        yield
    finally:
        for config, value in zip(configs, saved):
            config._attn_implementation = value
