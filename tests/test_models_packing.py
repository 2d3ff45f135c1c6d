"""Padding-free packed logprob passes (models.logprobs.pack_batch, models.attention): the packed layout on a
hand-made batch, per-segment attention against the block-diagonal mask and against a reference varlen kernel
(the flash-attn layout), and completion_logprobs(packed=True) equal to the padded pass in values (1e-5) and
gradients (1e-4) on tiny Llama and Qwen3 models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.packed import segment_mask
from models.attention import flash_varlen_attention, segment_attention, varlen_layout
from models.logprobs import completion_logprobs, pack_batch, pad_batch, prompt_groups
from tiny import tiny_model


def test_pack_batch_layout_by_hand():
    # Rows 0 and 2 share prompt [5, 6]; row 1 has its own prompt [7] and an empty completion; row 3 shares
    # row 1's prompt with a one-token completion.
    batch = pad_batch([[5, 6], [7], [5, 6], [7]], [[8, 9, 10], [], [11], [12]], pad_id=0)
    _, prompt_index = prompt_groups(batch["input_ids"], batch["attention_mask"], batch["prompt_len"])
    packed = pack_batch(batch, prompt_index)
    # Prompt [5, 6] once; row 0's completion without its last token [8, 9]; row 2's single token needs no
    # input. Then prompt [7]; rows 1 and 3 need no input (empty, one token).
    assert packed.input_ids.tolist() == [[5, 6, 8, 9, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0]]
    assert packed.segments == ((0, 2, 0, 0), (2, 4, 0, 2), (4, 5, 4, 4))
    # Row 0: token 8 from position 1 (prompt end), 9 from 2, 10 from 3; row 2: 11 from 1; row 3: 12 from 4.
    assert packed.predict_index.tolist() == [1, 2, 3, 1, 4]
    assert packed.labels.tolist() == [8, 9, 10, 11, 12]
    # Without sharing every row is one causal segment, prompt then completion.
    alone = pack_batch(batch)
    assert alone.input_ids.tolist() == [[5, 6, 8, 9, 7, 5, 6, 7]]
    assert alone.segments == ((0, 4, 0, 0), (4, 5, 4, 4), (5, 7, 5, 5), (7, 8, 7, 7))
    assert alone.predict_index.tolist() == [1, 2, 3, 6, 7]


def test_pack_batch_refuses_a_mask_with_holes():
    batch = pad_batch([[5]], [[8, 9, 10]], pad_id=0)
    batch["completion_mask"] = torch.tensor([[1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="completion_mask row 0 is not 2 ones followed by zeros"):
        pack_batch(batch)


def test_segment_mask_pattern():
    mask = segment_mask(((0, 2, 0, 0), (2, 4, 0, 2), (4, 5, 4, 4)), 5)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [1, 1, 1, 0, 0],   # a completion sees its whole prompt and itself causally
                    [1, 1, 1, 1, 0],
                    [0, 0, 0, 0, 1]]


SEGMENTS = ((0, 5, 0, 0), (5, 9, 0, 3), (9, 10, 0, 3), (10, 16, 10, 10), (16, 19, 10, 16))


def random_heads(seed: int, length: int = 19):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 4, length, 8, generator=generator)
    key, value = torch.randn(1, 2, length, 8, generator=generator), torch.randn(1, 2, length, 8, generator=generator)
    return query, key, value


def test_segment_attention_equals_sdpa_with_the_block_mask():
    query, key, value = random_heads(0)
    per_segment = segment_attention(query, key, value, SEGMENTS, scaling=0.3)
    masked = F.scaled_dot_product_attention(query, key, value, attn_mask=segment_mask(SEGMENTS, 19), scale=0.3,
                                            enable_gqa=True)
    torch.testing.assert_close(per_segment, masked, atol=1e-6, rtol=0)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash_attn_varlen_func's contract written as a loop: q [Nq, H, D], k/v [Nk, Hkv, D]; per sequence the
    causal mask is aligned bottom-right (query i sees keys up to i + len_k - len_q)."""
    assert causal and max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = []
    for s in range(len(cu_q) - 1):
        qs, ks = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1), k[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].transpose(0, 1)
        allowed = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool).tril(ks.shape[1] - qs.shape[1])
        out.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=allowed, scale=softmax_scale,
                                                  enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def test_varlen_layout_feeds_a_varlen_kernel_the_same_attention():
    """The CUDA path (flash_attn_varlen_func on keys gathered per segment) cannot run here; its layout is checked
    with a reference kernel that follows flash-attn's documented contract."""
    query, key, value = random_heads(1)
    layout = varlen_layout(SEGMENTS, torch.device("cpu"))
    assert layout["cu_seqlens_q"].tolist() == [0, 5, 9, 10, 16, 19] and layout["cu_seqlens_k"].dtype == torch.int32
    assert layout["cu_seqlens_k"].tolist() == [0, 5, 12, 16, 22, 31] and layout["max_seqlen_k"] == 9
    varlen = flash_varlen_attention(query, key, value, layout, 0.3, reference_varlen)
    torch.testing.assert_close(varlen, segment_attention(query, key, value, SEGMENTS, scaling=0.3), atol=1e-6, rtol=0)


def random_batch(seed: int, prompt_lengths, completion_lengths, group: int = 1):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in prompt_lengths]
    completions = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in completion_lengths]
    return pad_batch([p for p in prompts for _ in range(group)], completions, pad_id=2)


def gradients_of(model, batch, packed: bool, share_prompts: bool = True):
    model.zero_grad()
    logprobs, entropy = completion_logprobs(model, batch, temperature=0.7, chunk_size=4, with_entropy=True,
                                            share_prompts=share_prompts, packed=packed)
    ((logprobs - 0.3 * entropy) * batch["completion_mask"]).sum().backward()
    return logprobs, entropy, {name: p.grad.clone() for name, p in model.named_parameters()}


BATCHES = {
    # 3 prompts x 3 completions of uneven lengths (one empty, one of a single token): prompts shared.
    "grouped": lambda: random_batch(4, [5, 3, 7], [4, 1, 6, 0, 5, 3, 6, 6, 2], group=3),
    # distinct prompts, lengths 1..9: every row one causal segment.
    "distinct": lambda: random_batch(5, [5, 3, 7, 2], [9, 1, 4, 6]),
}


@pytest.mark.parametrize("arch, tie", [("llama", True), ("llama", False), ("qwen3", True), ("qwen3", False)])
@pytest.mark.parametrize("layout", ["grouped", "distinct"])
def test_packed_pass_equals_padded_pass_with_gradients(arch, tie, layout):
    model = tiny_model(arch, tie_word_embeddings=tie)
    batch = BATCHES[layout]()
    padded = gradients_of(model, batch, packed=False, share_prompts=False)
    packed = gradients_of(model, batch, packed=True)
    mask = batch["completion_mask"]
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=0)
    assert (packed[0][mask == 0] == 0).all() and (packed[1][mask == 0] == 0).all()
    for name, gradient in padded[2].items():
        # Gradients up to ~10 summed in another order over other shapes: float32 noise measured <= 1.5e-5.
        torch.testing.assert_close(packed[2][name], gradient, atol=1e-4, rtol=0, msg=name)


def test_packed_forward_runs_only_real_tokens_and_works_under_checkpointing():
    model = tiny_model("qwen3", tie_word_embeddings=False)
    batch = BATCHES["grouped"]()
    shapes = []
    model.model.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.last_hidden_state.shape)))
    expected = gradients_of(model, batch, packed=False, share_prompts=False)
    gradients_of(model, batch, packed=True)
    # Prompts 5 + 3 + 7 once, completions without their last token: 3+0+5 + 0+4+2 + 5+5+1 = 25.
    assert shapes[-1] == (1, 15 + 25, 64)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    checkpointed = gradients_of(model, batch, packed=True)
    torch.testing.assert_close(checkpointed[0], expected[0], atol=1e-5, rtol=0)
    for name, gradient in expected[2].items():
        torch.testing.assert_close(checkpointed[2][name], gradient, atol=1e-4, rtol=0, msg=name)


def test_packed_pass_refuses_sliding_window_models():
    model = tiny_model("qwen3")
    model.config.sliding_window, model.config.use_sliding_window = 8, True
    with pytest.raises(ValueError, match="sliding-window attention .*sliding_window=8"):
        completion_logprobs(model, BATCHES["distinct"](), packed=True)
    assert model.config._attn_implementation == "sdpa"  # nothing was switched
