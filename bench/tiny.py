"""A tiny random-weight causal LM (Llama- or Qwen3-shaped) for benchmarks' smoke runs and the tests (tests/tiny.py):
hidden 64, 2 layers, built in well under a second, with the embedded SmolLM2 tokenizer's vocabulary size and
special-token ids by default."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

# SmolLM2's special tokens, so that a tiny model generates and pads like the embedded default.
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2


def tiny_model(
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = True,
    vocab_size: int = 49152,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A random-weight LlamaForCausalLM or Qwen3ForCausalLM: hidden 64, 2 layers, 4 heads (head dim 16),
    2 key/value heads, MLP 128. The same seed gives the same weights; the global RNG is left untouched.

    initializer_range is 0.1 rather than HF's 0.02 so that random logits are far from uniform and tests that
    compare positions or tokens see differences well above float noise.
    """
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "llama":
        config = LlamaConfig(**shape)
    elif arch == "qwen3":
        config = Qwen3Config(**shape, use_sliding_window=False)
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen3', got {arch!r}")
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    return model.eval()
