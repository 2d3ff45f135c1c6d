"""One sampling step for the transformers engine: temperature, top-k, top-p, then a draw from a seeded
generator, returning the logprob of each drawn token under the distribution it was drawn from."""
from __future__ import annotations

import torch
from torch import Tensor


def truncate_logits(scaled_logits: Tensor, top_p: float, top_k: int) -> Tensor:
    """Set to -inf every logit outside the top-k set and outside the smallest top-p nucleus.

    scaled_logits: [A, V] float32, already divided by the temperature.
    top_k: 0 keeps everything; top_p: 1.0 keeps everything. The most likely token is always kept.
    Returns a new [A, V] tensor (the input is not modified).
    """
    vocab_size = scaled_logits.shape[-1]
    result = scaled_logits
    if 0 < top_k < vocab_size:
        kth_largest = torch.topk(result, top_k, dim=-1).values[:, -1:]
        result = result.masked_fill(result < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(result, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token: a token is dropped once the tokens above it already reach top_p,
        # so the nucleus is the smallest prefix whose mass is >= top_p (and never empty).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
        result = result.masked_fill(drop, float("-inf"))
    return result


def sample_next_tokens(
    logits: Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row and return (tokens [A] int64, logprobs [A] float32).

    logits: [A, V] raw next-token logits (any float dtype; the maths is done in float32).
    temperature 0 is greedy: argmax, with the logprob of the untempered distribution (as vLLM reports it).
    Otherwise the logprob is of log_softmax(logits / temperature) renormalised over the top-k/top-p set.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logprobs
    processed = truncate_logits(logits / temperature if temperature != 1.0 else logits, top_p, top_k)
    processed_logprobs = processed.log_softmax(dim=-1)
    tokens = draw_from_probabilities(processed_logprobs.exp(), generator)
    return tokens, processed_logprobs.gather(-1, tokens[:, None])[:, 0]


def draw_from_probabilities(probabilities: Tensor, generator: torch.Generator) -> Tensor:
    """One index per row, drawn with probability proportional to its entry: inverse-CDF sampling with one
    float64 uniform per row.

    probabilities: [A, V] float, >= 0, each row with a positive sum. Returns [A] int64.

    Why not torch.multinomial: it draws V exponential variates per row (786,432 for 16 rows of SmolLM2's
    vocabulary), a large share of a CPU decode step; this draws A uniforms and does one cumulative sum. The
    sum is in float64 so that a token of probability 1e-9 next to a cumulative mass of 0.5 keeps its share
    (in float32 the running sum's rounding step there is 6e-8).
    A zero-probability index is never returned: the first index whose cumulative sum exceeds u * total is one
    where the sum grew.
    """
    cumulative = probabilities.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    uniform = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probabilities.device)
    # u < 1, but u * total can round up to total: keep the target strictly below it.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True)[:, 0]
