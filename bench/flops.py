"""Model FLOPs of the phases of an RL step for a Llama/Qwen-style decoder, and the machine's measured peak, so
benchmarks can print model FLOPs utilisation (MFU) per phase.

Derivation (one forward pass; a multiply-add is 2 FLOPs). L layers, hidden d, h query heads of size d_h,
V vocabulary, N_body = the weight matrices of the decoder layers (every 2-D parameter except the V x d
embedding and output projection; norms, biases, activations and rotary embedding are elementwise work,
a few FLOPs per hidden unit, not counted):
- weight matmuls: every token multiplies every body weight once: 2 * N_body per token;
- the vocabulary projection: 2 * V * d per position whose logits are computed (prefill: the last prompt
  position; decode: each fed token; logprob passes: each completion token, as models.logprobs does);
- attention: a query at position p (counting from 1) attends to p keys (causal): q.k^T and the weighted sum
  of values are 2 * h * d_h * p FLOPs each, so 4 * L * h * d_h * p per token. Over a prefill of n tokens
  that is 4 * L * h * d_h * n(n+1)/2 (half of PaLM's full square, which counts masked scores too).
  Grouped-query attention shares keys between heads but every query head still does its own products, so h
  (not the key/value head count) is what counts.
- forward + backward = 3 x forward (the backward computes gradients for both inputs and weights of every
  matmul: twice the forward's products).
Only useful work counts: padding is not counted, and a prompt shared by G completions counts once wherever
the implementation runs it once (the engine's prefill, the trainer's shared-prompt or packed passes). So
MFU says how much of the machine's peak the step turns into the model's required arithmetic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class DecoderShape:
    """The numbers the FLOP counts need, read from a transformers config and the model's parameter count."""

    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    body_params: int  # elements of the 2-D weights outside the embedding and the output projection

    @classmethod
    def of(cls, model) -> "DecoderShape":
        config = model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        matrices = sum(p.numel() for p in model.parameters() if p.ndim == 2)  # a tied head is counted once
        untied = head.data_ptr() != embedding.data_ptr()
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
                   head_dim=head_dim, vocab=head.shape[0],
                   body_params=matrices - embedding.numel() - (head.numel() if untied else 0))

    def attention_prefix(self, first: int, last: int) -> int:
        """Attention FLOPs of the tokens at positions first..last (1-based, causal): 4 L h d_h sum(p)."""
        return 4 * self.layers * self.heads * self.head_dim * (last * (last + 1) - (first - 1) * first) // 2


def prefill_flops(shape: DecoderShape, prompt_lengths: Sequence[int]) -> int:
    """Forward FLOPs of prefilling each prompt once (the engine's prefill), with the logits of its last position."""
    return sum(2 * shape.body_params * n + shape.attention_prefix(1, n) + 2 * shape.vocab * shape.hidden
               for n in prompt_lengths)


def decode_flops(shape: DecoderShape, prompt_lengths: Sequence[int], completion_lengths: Sequence[int]) -> int:
    """Forward FLOPs of generating completions (one prompt length per completion): a completion of T tokens
    takes T - 1 decode passes (its first token comes from the prefill's logits), each feeding one token at
    positions n+1 .. n+T-1 with its logits."""
    total = 0
    for n, length in zip(prompt_lengths, completion_lengths, strict=True):
        steps = max(length - 1, 0)
        total += steps * (2 * shape.body_params + 2 * shape.vocab * shape.hidden)
        total += shape.attention_prefix(n + 1, n + steps) if steps else 0
    return total


def logprob_pass_flops(shape: DecoderShape, distinct_prompt_lengths: Sequence[int], prompt_lengths: Sequence[int],
                       completion_lengths: Sequence[int]) -> int:
    """Forward FLOPs of one logprob pass: each distinct prompt once; of a completion of T tokens, the T - 1
    that predict a next one (its last token is only a label) at positions n+1 .. n+T-1; the vocabulary
    projection at the T positions that predict completion tokens. Multiply by 3 for forward + backward."""
    total = sum(2 * shape.body_params * n + shape.attention_prefix(1, n) for n in distinct_prompt_lengths)
    for n, length in zip(prompt_lengths, completion_lengths, strict=True):
        fed = max(length - 1, 0)
        total += fed * 2 * shape.body_params + length * 2 * shape.vocab * shape.hidden
        total += shape.attention_prefix(n + 1, n + fed) if fed else 0
    return total


def measure_peak_flops(size: int = 2048, repeats: int = 5) -> dict:
    """The machine's fp32 matmul rate at torch's current thread count: the best of `repeats` timed
    [size, size] x [size, size] products (after one warm-up), in FLOP/s."""
    import torch

    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator)
    right = torch.randn(size, size, generator=generator)
    torch.mm(left, right)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(left, right)
        best = min(best, time.perf_counter() - started)
    return {"flops_per_s": 2 * size**3 / best, "size": size, "repeats": repeats, "threads": torch.get_num_threads()}


def step_flops(shape: DecoderShape, *, prompts: Sequence[Sequence[int]], group: int,
               completion_lengths: Sequence[int], micro_batch_size: int, ppo_epochs: int, logprob_passes: int) -> dict:
    """Model FLOPs of one RL step by phase, as the trainer runs it: the engine prefills each of the P distinct
    prompts once and decodes P x G completions; the update runs ppo_epochs forward+backward passes over
    micro-batches of micro_batch_size consecutive completions (each distinct prompt once per micro-batch);
    logprob_passes forward-only passes (old logprobs when ppo_epochs > 1, a reference model) do the same work.
    Returns {"prefill", "decode", "logprob", "update", "step"} in FLOPs."""
    rows = [list(prompt) for prompt in prompts for _ in range(group)]
    if len(rows) != len(completion_lengths):
        raise ValueError(f"{len(prompts)} prompts x G={group} make {len(rows)} rows, but {len(completion_lengths)} "
                         f"completion lengths were given")
    prompt_lengths = [len(row) for row in rows]
    pass_flops = 0
    for start in range(0, len(rows), micro_batch_size):
        chunk = slice(start, start + micro_batch_size)
        distinct = {tuple(row) for row in rows[chunk]}
        pass_flops += logprob_pass_flops(shape, [len(prompt) for prompt in distinct], prompt_lengths[chunk],
                                         completion_lengths[chunk])
    flops = {"prefill": prefill_flops(shape, [len(prompt) for prompt in prompts]),
             "decode": decode_flops(shape, prompt_lengths, completion_lengths),
             "logprob": logprob_passes * pass_flops, "update": 3 * ppo_epochs * pass_flops}
    flops["step"] = sum(flops.values())
    return flops
