"""The transformers engine's CPU fast path (rollout.cpu_decode: written-out prefill and decode step, shared-prompt
KV buffers, native grouped-query attention, oneDNN-reordered projections) and its inverse-CDF draws against plain
transformers, on tiny random Llama and Qwen3 models: greedy tokens identical to `model.generate`, finished rows
dropped without changing the others, and sampled logprobs equal to the trainer's recomputation within 1e-4."""
from __future__ import annotations

import pytest
import torch

from models import load_tokenizer
from models.logprobs import completion_logprobs, pad_batch
from tiny import tiny_model
from rollout.cpu_decode import CPUDecoding, KVBuffer, supported
from rollout.hf_engine import HFEngine

# Prompts of different lengths, so rows are left-padded by different amounts.
PROMPTS = [[1, 504, 3458, 282, 77, 9021], [1, 18, 19], [1, 4000, 12, 13, 14]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def reference_greedy(model, prompts, max_new_tokens):
    """transformers' own greedy generate (DynamicCache, its attention), one prompt at a time (no padding)."""
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            output = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                    min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=2)
            rows.append(output[0, len(prompt):].tolist())
    return rows


@pytest.mark.parametrize("arch, attention", [("llama", "sdpa"), ("qwen3", "sdpa"), ("llama", "eager")])
def test_greedy_tokens_equal_transformers_generate(tokenizer, arch, attention):
    model = tiny_model(arch)
    model.config._attn_implementation = attention  # eager: the engine keeps the model's own forward
    engine = HFEngine(model, tokenizer, eos_token_ids=[])
    assert supported(model) == (attention == "sdpa")  # the path under test is the one intended
    completions = engine.generate(PROMPTS, n=2, max_new_tokens=12, temperature=0.0, top_p=1.0, top_k=0,
                                  stop=None, seed=None)
    expected = reference_greedy(model, PROMPTS, 12)
    assert [c.completion_ids for c in completions] == [row for row in expected for _ in range(2)]


def trainer_logprobs(model, completions, temperature):
    batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, batch, temperature=temperature, share_prompts=False)
    return [logprobs[row, : len(c.completion_ids)] for row, c in enumerate(completions)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_finished_rows_leave_without_changing_the_others(tokenizer, arch):
    """An eos id that greedy decoding emits mid-way ends some rows early; the rows that go on produce exactly
    what they produce when nothing stops (the cache rows they keep are theirs)."""
    model = tiny_model(arch)
    free = reference_greedy(model, PROMPTS, 10)
    # A token that the second prompt's greedy continuation reaches after its first step and the others never do.
    eos = next(token for token in free[1][1:] if token not in free[0] and token not in free[2])
    completions = HFEngine(model, tokenizer, eos_token_ids=[eos]).generate(
        PROMPTS, n=1, max_new_tokens=10, temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None)
    for completion, row in zip(completions, free):
        cut = row.index(eos) + 1 if eos in row else len(row)
        assert completion.completion_ids == row[:cut]
        assert completion.finish_reason == ("stop" if eos in row else "length")
    assert [c.finish_reason for c in completions] == ["length", "stop", "length"]
    assert 2 <= len(completions[1].completion_ids) < 10


@pytest.mark.parametrize("arch, temperature", [("llama", 1.0), ("qwen3", 0.7)])
def test_sampled_logprobs_equal_recomputation_within_1e_4(tokenizer, arch, temperature):
    model = tiny_model(arch)
    # 3,000 end ids (about 6% of a random model's mass per token): rows stop at uneven steps and leave the batch.
    engine = HFEngine(model, tokenizer, eos_token_ids=range(3, 3003))
    completions = engine.generate(PROMPTS, n=3, max_new_tokens=16, temperature=temperature, top_p=1.0, top_k=0,
                                  stop=None, seed=5)
    assert len({len(c.completion_ids) for c in completions}) >= 3
    recomputed = trainer_logprobs(model, completions, temperature)
    for completion, expected in zip(completions, recomputed):
        assert len(completion.logprobs) == len(completion.completion_ids) >= 1
        # fp32: the incremental KV-cache pass and one full pass differ by float rounding only (~1e-6).
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_same_seed_same_sample_and_stop_strings_cut(tokenizer):
    model = tiny_model("llama")
    engine = HFEngine(model, tokenizer)
    options = dict(n=3, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, seed=11)
    first, again = engine.generate(PROMPTS, stop=None, **options), engine.generate(PROMPTS, stop=None, **options)
    assert [c.completion_ids for c in first] == [c.completion_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    # A stop string taken from one sampled completion's text: that row must end at the token completing it.
    text = first[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2] if len(text) >= 4 else text
    stopped = engine.generate(PROMPTS, stop=[stop], **options)
    for completion in stopped:
        before_last = tokenizer.decode(completion.completion_ids[:-1], skip_special_tokens=True)
        assert stop not in before_last
        if completion.finish_reason == "stop" and completion.completion_ids[-1] != 2:
            assert stop in completion.text
    assert stop in stopped[0].text and stopped[0].finish_reason == "stop"


def test_decode_step_support_is_limited_to_llama_family():
    assert supported(tiny_model("llama")) and supported(tiny_model("qwen3"))
    model = tiny_model("llama")
    model.config.model_type = "gemma"  # a different architecture: the model's own forward is used
    assert not supported(model)
    model = tiny_model("qwen3")
    model.config.sliding_window, model.config.use_sliding_window = 4, True
    assert not supported(model)


def test_kv_buffer_appends_selects_rows_and_refuses_overflow():
    cache = KVBuffer(capacity=4)
    first = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)  # [rows, heads, tokens, dim]
    keys, values = cache.append(first, -first)
    assert keys.shape == (2, 1, 3, 2) and torch.equal(keys, first) and torch.equal(values, -first)
    cache.keep(torch.tensor([1, 1, 0]))
    step = torch.full((3, 1, 1, 2), 7.0)
    keys, _ = cache.append(step, step)
    assert torch.equal(keys[:, :, :3], first[[1, 1, 0]]) and torch.equal(keys[:, :, 3:], step)
    assert cache.length == 4
    with pytest.raises(ValueError, match="KV cache overflow: 5 tokens in a cache allocated for 4"):
        cache.append(step, step)


def with_biases(model):
    """Give every projection a random bias (Qwen2 has q/k/v biases; Llama's attention_bias/mlp_bias)."""
    generator = torch.Generator().manual_seed(3)
    for layer in model.get_decoder().layers:
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            module.bias = torch.nn.Parameter(0.1 * torch.randn(module.out_features, generator=generator))
    return model


@pytest.mark.parametrize("arch, biases", [("llama", False), ("qwen3", False), ("llama", True)])
def test_reordered_projections_equal_the_modules_within_float_rounding(arch, biases):
    """A decode step on CPUDecoding's stacked, oneDNN-reordered projections against one calling the modules,
    after the same prefill: hidden states and head logits equal to float rounding."""
    model = tiny_model(arch)
    if biases:
        with_biases(model)
    packed, modules = CPUDecoding(model, prompts=3, n=1, capacity=1), CPUDecoding(model, prompts=3, n=1, capacity=1)
    assert all(projection.weight is not None for layer in packed.projections for projection in layer)
    assert len(packed.projections) == 2 and packed.head.weight is not None
    for projection in [modules.head, *(projection for layer in modules.projections for projection in layer)]:
        projection.weight = None  # call the modules, as for a LoRA-wrapped projection
    prompt = torch.tensor([PROMPTS[0]] * 3)
    outputs = []
    with torch.no_grad():
        for decoding in (modules, packed):
            decoding.prefill(prompt, torch.ones_like(prompt), torch.arange(prompt.shape[1])[None].expand(3, -1))
            head, decoding.head = decoding.head, lambda hidden: (hidden,)  # step's hidden states, before the head
            hidden = decoding.step(torch.tensor([5, 77, 4000]), torch.full((3, 1), prompt.shape[1]))
            outputs.append((hidden, head(hidden)[0]))
    (hidden, logits), (packed_hidden, packed_logits) = outputs
    assert hidden.abs().max() > 0.1  # a real signal, not zeros
    torch.testing.assert_close(packed_hidden, hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_logits, logits, atol=1e-5, rtol=1e-5)


def test_lora_wrapped_projections_are_not_reordered():
    """A LoRA-wrapped projection computes more than its base weight: the engine keeps calling the modules."""
    from models.lora import apply_lora

    model = tiny_model("llama")
    assert all(qkv.weight is not None for qkv, *_ in CPUDecoding(model, prompts=2, n=1, capacity=1).projections)
    apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0)
    assert all(qkv.weight is None for qkv, *_ in CPUDecoding(model, prompts=2, n=1, capacity=1).projections)
