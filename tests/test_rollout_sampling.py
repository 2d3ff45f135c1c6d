"""The transformers engine's sampling step and the request checks shared by every engine, on hand-derived
numbers (no model needed)."""
from __future__ import annotations

import math

import pytest
import torch

from rollout.engine import validate_request
from rollout.hf_engine import draw_from_probabilities, sample_next_tokens, truncate_logits

# Probabilities 0.5, 0.3, 0.15, 0.05 as logits (softmax of log p is p).
PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Mass before each sorted token: 0, 0.5, 0.8, 0.95. top_p 0.6 drops tokens whose preceding mass is >= 0.6.
    kept = truncate_logits(LOGITS, top_p=0.6, top_k=0).softmax(-1)
    assert kept.tolist()[0] == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], abs=1e-6)
    # top_p 0.5 is reached by the first token alone, so the rest go (vLLM's rule -- mask a token while the
    # ascending cumulative mass up to it is <= 1 - p -- gives the same set).
    assert truncate_logits(LOGITS, top_p=0.5, top_k=0).softmax(-1).tolist()[0] == pytest.approx([1, 0, 0, 0])


def test_top_k_and_no_truncation():
    assert truncate_logits(LOGITS, top_p=1.0, top_k=2).softmax(-1).tolist()[0] == pytest.approx(
        [0.5 / 0.8, 0.3 / 0.8, 0, 0], abs=1e-6
    )
    assert torch.equal(truncate_logits(LOGITS, top_p=1.0, top_k=0), LOGITS)
    assert torch.equal(truncate_logits(LOGITS, top_p=1.0, top_k=4), LOGITS)  # k = V keeps everything


def test_sampled_logprob_is_of_the_tempered_truncated_distribution():
    generator = torch.Generator().manual_seed(0)
    logits = LOGITS.repeat(2000, 1)
    tokens, logprobs = sample_next_tokens(logits, temperature=0.5, top_p=1.0, top_k=2, generator=generator)
    # Temperature 0.5 squares the probabilities: 0.25 and 0.09 over the top 2 -> 0.25/0.34 and 0.09/0.34.
    expected = {0: math.log(0.25 / 0.34), 1: math.log(0.09 / 0.34)}
    assert set(tokens.tolist()) == {0, 1}
    for token, logprob in zip(tokens.tolist(), logprobs.tolist()):
        assert logprob == pytest.approx(expected[token], abs=1e-5)
    share = (tokens == 0).float().mean().item()
    assert share == pytest.approx(0.25 / 0.34, abs=0.04)  # 2000 draws: std about 0.01


def test_greedy_and_seeded_draws():
    tokens, logprobs = sample_next_tokens(LOGITS, temperature=0.0, top_p=1.0, top_k=0, generator=torch.Generator())
    assert tokens.tolist() == [0] and logprobs.tolist() == pytest.approx([math.log(0.5)], abs=1e-6)
    draws = [sample_next_tokens(LOGITS.repeat(50, 1), temperature=1.0, top_p=1.0, top_k=0,
                                generator=torch.Generator().manual_seed(seed))[0].tolist() for seed in (3, 3, 4)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_inverse_cdf_draw_follows_the_probabilities_and_never_a_zero():
    # Unnormalised rows (sum 2): shares 0.5, 0.3, 0.2 over 20,000 draws (std <= 0.0036; 0.015 is 4 std).
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.6, 0.4, 0.0]]).repeat(20000, 1)
    tokens = draw_from_probabilities(weights, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).double() / len(tokens)
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert counts[[1, 3, 4]].tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.015)
    # A single non-zero entry at either end is always drawn, whatever the uniform.
    edges = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 3.0]]).repeat(500, 1)
    assert draw_from_probabilities(edges, torch.Generator().manual_seed(1)).tolist() == [0, 2] * 500


GOOD = dict(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=None,
            max_context=16, vocab_size=100)


@pytest.mark.parametrize("prompts, overrides, message", [
    ([], {}, "prompts must be a non-empty list"),
    ([[1, 2]], {"n": 0}, r"n \(completions per prompt\) must be an integer >= 1, got 0"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ([[1, 2]], {"temperature": -1.0}, "temperature must be >= 0 .* got -1.0"),
    ([[1, 2]], {"temperature": float("nan")}, "temperature must be >= 0 .* got nan"),
    ([[1, 2]], {"top_p": 0.0}, r"top_p must lie in \(0, 1\] .* got 0.0"),
    ([[1, 2]], {"top_k": -1}, "top_k must be an integer >= 0 .* got -1"),
    ([[1, 2]], {"seed": -3}, "seed must be None or an integer >= 0, got -3"),
    ([[1, 2]], {"stop": "\n"}, "stop must be a list of strings"),
    ([[1, 2]], {"stop": ["a", ""]}, r"stop\[1\] must be a non-empty string"),
    ([[1, 2], []], {}, "prompt 1 must be a non-empty list of token ids"),
    ([[1] * 16], {}, "prompt 0 has 16 tokens but the context holds 16: no new token fits"),
    ([[1, 2], [1] * 20], {}, "prompt 1 has 20 tokens but the context holds 16"),
    ([[1, 100]], {}, r"prompt 0 holds token id 100, outside the vocabulary \[0, 100\)"),
    ([[-1, 5]], {}, "prompt 0 holds token id -1"),
])
def test_bad_requests_name_the_value(prompts, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_request(prompts, **{**GOOD, **overrides})


def test_good_request_returns_the_stop_list():
    assert validate_request([[1] * 15], **{**GOOD, "stop": ("\n", "</answer>")}) == ["\n", "</answer>"]
