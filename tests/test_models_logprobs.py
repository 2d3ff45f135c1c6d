"""Batch layout and chunked logprobs/entropy: values and gradients equal the textbook
log_softmax(logits.float() / T).gather on the full logits, on tiny random Llama and Qwen3 models."""
import doctest

import pytest
import torch

import models.logprobs
from models.logprobs import LogprobsFromHidden, completion_logprobs, pad_batch, prompt_groups
from tiny import tiny_model


def naive(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    log_distribution = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = log_distribution.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_distribution.exp() * log_distribution).sum(-1)
    return logprobs, entropy


def random_pairs(seed: int, prompt_lengths, completion_lengths):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in prompt_lengths]
    completions = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in completion_lengths]
    return prompts, completions


def test_pad_batch_doctest():
    assert doctest.testmod(models.logprobs).failed == 0


def test_pad_batch_layout():
    batch = pad_batch([[11, 12, 13], [21]], [[14], [22, 23, 24]], pad_id=0)
    assert batch["prompt_len"] == 3
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 0, 0], [0, 0, 21, 22, 23, 24]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]]
    assert batch["completion_mask"].tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert batch["completion_mask"].dtype == torch.float32 and batch["input_ids"].dtype == torch.long


@pytest.mark.parametrize(
    "prompts, completions, message",
    [([], [], "at least one"), ([[1]], [[2], [3]], "1 prompts but 2 completions"), ([[1], []], [[2], [3]], "prompt 1 is empty")],
)
def test_pad_batch_rejects_bad_input(prompts, completions, message):
    with pytest.raises(ValueError, match=message):
        pad_batch(prompts, completions, pad_id=0)


def test_pad_batch_rejects_non_int_pad():
    with pytest.raises(ValueError, match="pad_id"):
        pad_batch([[1]], [[2]], pad_id=None)


def chunked(logits, labels, *, temperature, chunk_size):
    """The chunked kernel on given logits [B, T, V] -> (logprobs, entropy) [B, T] float32: the logits as the
    hidden states and an identity output projection, which is exact (each logit is x * 1 plus zeros, in fp32),
    so values and gradients with respect to the logits are the kernel's own."""
    batch, length, vocab = logits.shape
    identity = torch.eye(vocab, dtype=logits.dtype)
    logprobs, entropy = LogprobsFromHidden.apply(logits.reshape(batch * length, vocab), identity, None,
                                                 labels.reshape(-1), temperature, chunk_size, True)
    return logprobs.view(batch, length), entropy.view(batch, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_entropy_equal_naive(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 1000, generator=generator) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 1000, (3, 7), generator=generator)
    values, _ = chunked(logits, labels, temperature=0.7, chunk_size=4)
    _, entropy = chunked(logits, labels, temperature=0.7, chunk_size=5)
    (values * 1.3 + entropy * 0.4).sum().backward()
    gradient, logits.grad = logits.grad, None
    expected_values, expected_entropy = naive(logits, labels, 0.7)
    (expected_values * 1.3 + expected_entropy * 0.4).sum().backward()
    assert values.dtype == torch.float32 and values.shape == (3, 7)
    torch.testing.assert_close(values, expected_values, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    # bf16 gradients are rounded once (to bf16) in both paths; allow one bf16 ulp of the largest entry.
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gradient.float(), logits.grad.float(), atol=tolerance, rtol=tolerance)


def test_completion_logprobs_shape_and_argument_errors():
    model, batch = tiny_model("llama"), pad_batch([[5, 6]], [[7, 8]], pad_id=2)
    with pytest.raises(ValueError, match=r"\[B, Lp\+T\]"):
        completion_logprobs(model, {**batch, "input_ids": batch["input_ids"][0]})
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(model, batch, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        completion_logprobs(model, batch, chunk_size=0)


@pytest.mark.parametrize("arch, tie", [("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)])
def test_completion_logprobs_equal_naive_with_gradients(arch, tie):
    model = tiny_model(arch, tie_word_embeddings=tie)
    batch = pad_batch(*random_pairs(1, [5, 3, 7], [4, 6, 1]), pad_id=2)
    temperature = 0.7
    logprobs, entropy = completion_logprobs(model, batch, temperature=temperature, chunk_size=3, with_entropy=True)
    ((logprobs * 1.0 + 0.3 * entropy) * batch["completion_mask"]).sum().backward()
    fused = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()

    prompt_len, length = batch["prompt_len"], batch["completion_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    expected_logprobs, expected_entropy = naive(logits[:, prompt_len - 1 : prompt_len - 1 + length], batch["input_ids"][:, prompt_len:], temperature)
    mask = batch["completion_mask"]
    ((expected_logprobs + 0.3 * expected_entropy) * mask).sum().backward()

    torch.testing.assert_close(logprobs, expected_logprobs * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy * mask, atol=1e-5, rtol=0)
    assert (logprobs[mask == 0] == 0).all() and (entropy[mask == 0] == 0).all()
    for name, parameter in model.named_parameters():
        assert_gradients_close(fused[name], parameter.grad, name)


def assert_gradients_close(actual, expected, name):
    """Gradients of two passes that sum the same float32 terms in a different order (chunked vs one matmul,
    shared-prompt vs plain): the rounding error scales with the largest term summed, not with each entry, so
    the bound is 1e-5 of the tensor's largest gradient. (The former per-entry bound, 1e-5 + 1e-5 * |g|, failed
    with transformers 5.19: 4.2e-5 on an embedding gradient whose largest entry is 13.1, i.e. 3e-6 of it.)"""
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=0, msg=name)


def test_completion_logprobs_projects_only_one_position_through_lm_head():
    model = tiny_model("llama")
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    batch = pad_batch(*random_pairs(2, [4, 6], [5, 3]), pad_id=2)
    logprobs, entropy = completion_logprobs(model, batch)
    # The model's own lm_head sees only the last column; completion positions are projected in chunks.
    assert shapes == [(2, 1, 49152)]
    assert entropy is None and logprobs.shape == (2, 5)


def test_completion_logprobs_with_gradient_checkpointing_matches():
    model = tiny_model("qwen3", tie_word_embeddings=False)
    batch = pad_batch(*random_pairs(3, [4, 2], [3, 5]), pad_id=2)
    plain, _ = completion_logprobs(model, batch)
    plain.sum().backward()
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    checkpointed, _ = completion_logprobs(model, batch)
    checkpointed.sum().backward()
    torch.testing.assert_close(checkpointed, plain, atol=0, rtol=0)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name], atol=1e-6, rtol=1e-6, msg=name)


def grouped_batch(seed: int, prompt_lengths, completion_lengths, group: int):
    """Each prompt repeated `group` times in consecutive rows, as GRPO lays out P x G completions."""
    prompts, completions = random_pairs(seed, prompt_lengths, completion_lengths)
    return pad_batch([p for p in prompts for _ in range(group)], completions, pad_id=2)


def test_prompt_groups_numbers_distinct_prompts_by_first_row():
    ids = torch.tensor([[0, 7, 1], [4, 5, 1], [0, 7, 2], [4, 5, 3], [0, 0, 4]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    # Row 4's prompt [0 (a real token), 0 (padding)] differs from padding-only: the mask tells them apart.
    mask[4, 1] = 0
    rows, index = prompt_groups(ids, mask, prompt_len=2)
    assert rows.tolist() == [0, 1, 4] and index.tolist() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen3", False)])
def test_shared_prompt_pass_equals_plain_pass_with_gradients(arch, tie):
    model = tiny_model(arch, tie_word_embeddings=tie)
    # 3 prompts x 3 completions of uneven lengths (one empty completion, one of a single token).
    batch = grouped_batch(4, [5, 3, 7], [4, 1, 6, 0, 5, 3, 6, 6, 2], group=3)
    forwards = []
    model.model.register_forward_hook(lambda module, args, output: forwards.append(tuple(output.last_hidden_state.shape)))
    results = {}
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = completion_logprobs(model, batch, temperature=0.7, chunk_size=4, with_entropy=True,
                                                share_prompts=share)
        ((logprobs - 0.3 * entropy) * batch["completion_mask"]).sum().backward()
        results[share] = logprobs, entropy, {name: p.grad.clone() for name, p in model.named_parameters()}
    # Plain: one pass over [9, 7 + 6]; shared: the 3 distinct prompts, then the 9 completions on their cache.
    assert forwards == [(9, 13, 64), (3, 7, 64), (9, 6, 64)]
    # A few float32 ulps: a logprob near -10 has an ulp of 9.5e-7, so the bound is relative too (transformers
    # 5.19 rounds one entry 1.9e-6 = 2 ulps away; rtol=0 with atol=1e-6 allowed only 1).
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-6, rtol=1e-6)
    assert (results[True][0][batch["completion_mask"] == 0] == 0).all()
    for name, gradient in results[False][2].items():
        assert_gradients_close(results[True][2][name], gradient, name)


def test_prompts_are_shared_under_gradient_checkpointing_by_the_packed_pass():
    # Checkpointed layers drop the KV cache the shared-prompt pass runs on, so under gradient checkpointing the
    # prompts are shared by the packed pass: U*Lp + sum(T_b - 1) tokens in one row instead of B*(Lp+T).
    # Its logprobs and gradients equal the plain pass's; distinct prompts (nothing to share) stay plain.
    model = tiny_model("qwen3", tie_word_embeddings=False)
    forwards = []
    model.model.register_forward_hook(lambda module, args, output: forwards.append(tuple(output.last_hidden_state.shape)))
    grouped = grouped_batch(5, [4, 2], [3, 5, 2, 4], group=2)
    results = {}
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model.zero_grad()
        logprobs, _ = completion_logprobs(model, grouped, share_prompts=checkpointing)
        (logprobs * grouped["completion_mask"]).sum().backward()
        results[checkpointing] = logprobs, {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-6, rtol=1e-6)
    for name, gradient in results[False][1].items():
        assert_gradients_close(results[True][1][name], gradient, name)
    completion_logprobs(model, pad_batch(*random_pairs(6, [4, 2], [3, 5]), pad_id=2))  # nothing to share
    # Plain [4 rows, 4 + 5]; packed: prompts 4 + 2, completions (3-1) + (5-1) + (2-1) + (4-1) = 16; plain again.
    assert forwards == [(4, 9, 64), (1, 16, 64), (2, 9, 64)]


def test_completion_logprobs_rejects_bad_batch_and_softcapped_models():
    model = tiny_model("llama")
    batch = pad_batch([[5, 6]], [[7, 8]], pad_id=2)
    with pytest.raises(ValueError, match="completion_mask"):
        completion_logprobs(model, {**batch, "completion_mask": torch.ones(1, 3)})
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        completion_logprobs(model, batch)
