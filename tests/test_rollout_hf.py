"""HFEngine specifics on a tiny random model: train mode restored, weights updated by name (or not at all
when shared), nothing taken from generation_config, the context cap, a padded vocabulary, and the
out-of-memory message."""
from __future__ import annotations

import os

import pytest
import torch

from models import load_tokenizer
from tiny import tiny_model
from rollout.hf_engine import HFEngine

PROMPTS = [[1, 504, 3458, 282], [1, 18, 19]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def sample(engine, **overrides):
    options = dict(n=2, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=0)
    options.update(overrides)
    return engine.generate(PROMPTS, **options)


def test_train_mode_is_restored_and_no_grad_is_kept(tokenizer):
    model = tiny_model().train()
    completions = sample(HFEngine(model, tokenizer))
    assert model.training and len(completions) == 4
    assert all(parameter.grad is None for parameter in model.parameters())
    model.eval()
    sample(HFEngine(model, tokenizer))
    assert not model.training


def test_generation_config_is_ignored(tokenizer):
    model = tiny_model()
    before = sample(HFEngine(model, tokenizer))
    model.generation_config.temperature, model.generation_config.top_k = 0.01, 1
    model.generation_config.max_new_tokens, model.generation_config.do_sample = 1, False
    after = sample(HFEngine(model, tokenizer))
    assert [c.completion_ids for c in after] == [c.completion_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]


def test_update_weights_copies_by_name_unless_shared(tokenizer):
    policy, owned = tiny_model(seed=1), tiny_model(seed=2)
    engine = HFEngine(owned, tokenizer, shared=False)
    engine.update_weights(policy.named_parameters())
    for (name, source), target in zip(policy.named_parameters(), owned.parameters()):
        assert torch.equal(source, target), name
    assert [c.completion_ids for c in sample(engine)] == [c.completion_ids for c in sample(HFEngine(policy, tokenizer))]
    with pytest.raises(ValueError, match="no parameter named 'model.missing.weight'"):
        engine.update_weights([("model.missing.weight", torch.zeros(1))])
    with pytest.raises(RuntimeError, match=r"model.norm.weight: .* shape torch.Size\(\[3\]\) .* torch.Size\(\[64\]\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    shared = HFEngine(policy, tokenizer, shared=True)
    consumed = []
    shared.update_weights((consumed.append(name) or (name, torch.zeros(1)) for name in ("a", "b")))
    assert consumed == ["a", "b"]  # the stream is drained (a distributed producer may need it) but ignored
    assert torch.equal(policy.model.norm.weight, owned.model.norm.weight)


def test_each_prompt_is_prefilled_once(tokenizer):
    model = tiny_model()
    batch_shapes = []
    # The embedding sees every forward: the prefill and each decode step.
    model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: batch_shapes.append(tuple(output.shape)))
    completions = sample(HFEngine(model, tokenizer, eos_token_ids=[]), n=3, max_new_tokens=2)
    # The 2 prompts (left-padded to 4) run once; their caches then serve 3 rows each.
    assert batch_shapes == [(2, 4, 64), (6, 1, 64)]
    assert [c.prompt_ids for c in completions] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len({tuple(c.completion_ids) for c in completions[:3]}) > 1  # the n rows sample independently


def test_completions_stop_at_the_context(tokenizer):
    engine = HFEngine(tiny_model(), tokenizer, max_context=7, eos_token_ids=[])
    completions = sample(engine, max_new_tokens=10)
    # Prompts of 4 and 3 tokens leave 3 and 4 new tokens in a context of 7.
    assert [len(c.completion_ids) for c in completions] == [3, 3, 4, 4]
    assert {c.finish_reason for c in completions} == {"length"}


def test_padded_vocabulary_ids_are_never_sampled(tokenizer):
    # 49,152 tokenizer entries, 49,160 model rows: the 8 extra ids have no text.
    model = tiny_model(vocab_size=49160)
    with torch.no_grad():
        model.lm_head.weight[49152:] = 5.0  # make them by far the likeliest
    completions = sample(HFEngine(model, tokenizer), max_new_tokens=8)
    assert max(token for c in completions for token in c.completion_ids) < 49152


def test_out_of_memory_is_reraised_with_the_batch_size(tokenizer, monkeypatch):
    model = tiny_model().train()

    def exhausted(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(model.model.embed_tokens, "forward", exhausted)  # the first module every pass runs
    with pytest.raises(RuntimeError, match="out of memory while generating 4 sequences of up to 6 new tokens: "
                                           "pass fewer prompts per generate call"):
        sample(HFEngine(model, tokenizer))
    assert model.training  # restored on the error path too


def test_an_fsdp_sharded_model_is_refused(tokenizer):
    class DTensor(torch.nn.Parameter):  # stands in for torch.distributed.tensor.DTensor (matched by name)
        pass

    model = tiny_model()
    model.model.norm.weight = DTensor(model.model.norm.weight.detach())
    with pytest.raises(ValueError, match="'model.norm.weight' is an FSDP DTensor: build the engine on a full copy"):
        HFEngine(model, tokenizer)


def test_generation_runs_at_one_thread_and_restores_the_callers(tokenizer):
    model = tiny_model()
    seen = []
    model.model.embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    torch.set_num_threads(2)
    try:
        sample(HFEngine(model, tokenizer, num_threads=1))
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        sample(HFEngine(model, tokenizer))  # None (the default): the caller's setting is used as is
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
