"""One RL step's vLLM engine calls run in the order the plan prints (launch.plan.CUDA_VLLM_CYCLE): the real
VLLMEngine methods and rollout.sync.sync_weights drive a recording stand-in for vllm.LLM, with CUDA's
empty_cache recorded too, so the order is checked here without a GPU."""
from __future__ import annotations

import torch

from launch.plan import CUDA_VLLM_CYCLE
from rollout.sync import sync_weights, weight_group
from rollout.vllm_engine import VLLMEngine
from tiny import tiny_model


class RecordingLLM:
    """The calls VLLMEngine makes on vllm.LLM, by the names the plan uses."""

    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags):
        self.calls.append(f"wake_up(tags={tags})")

    def collective_rpc(self, function):
        self.calls.append("update_weights")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def test_sleep_and_sync_follow_the_planned_cycle(monkeypatch):
    calls = []
    model = tiny_model(vocab_size=256)
    engine = object.__new__(VLLMEngine)  # the engine's own methods around a recording vllm.LLM
    groups = {}
    for name, _ in model.named_parameters():
        groups.setdefault(weight_group(name), set()).add(name)
    engine.llm, engine.sleeps, engine.asleep = RecordingLLM(calls), True, set()
    engine.tied_embedding_name, engine.checkpoint_groups = None, groups
    engine.in_process = True
    engine.model_path = "tiny"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    calls.append("generate")
    engine.sleep()
    calls.append("train")
    info = sync_weights(model, engine, bucket_bytes=1 << 30)
    # One bucket here: one update_weights (and its prefix-cache reset) between the two wakes.
    assert info["sync/buckets"] == 1
    assert calls == list(CUDA_VLLM_CYCLE)
    assert engine.asleep == set()
    # A sync while awake (the first one, after the engine is built) wakes nothing.
    calls.clear()
    sync_weights(model, engine, bucket_bytes=1 << 30)
    assert calls == ["update_weights", "reset_prefix_cache", "empty_cache"]
