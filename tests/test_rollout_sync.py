"""Bucketed weight sync on one process: buckets never split a decoder layer, stay under the size bound,
deliver every weight once in order, and `sync_weights` reports what it streamed."""
from __future__ import annotations

import pytest
import torch

from tiny import tiny_model
from rollout.sync import bucketed, sync_weights, tensor_bytes, weight_group


class RecordingEngine:
    """Stands in for an engine: keeps the (name, shape, bytes) of every update_weights call."""

    def __init__(self):
        self.calls: list[list[tuple[str, tuple, int]]] = []

    def update_weights(self, named_tensors):
        self.calls.append([(name, tuple(t.shape), tensor_bytes(t)) for name, t in named_tensors])

    def wake(self, tags):
        pass


def test_weight_group_names_the_decoder_layer_or_module():
    assert weight_group("model.layers.0.self_attn.q_proj.weight") == "model.layers.0."
    assert weight_group("model.layers.17.mlp.gate_proj.weight") == "model.layers.17."
    assert weight_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert weight_group("lm_head.weight") == "lm_head"
    assert weight_group("bias") == "bias"


def stream(sizes: list[tuple[str, int]]):
    return [(name, torch.zeros(size // 4)) for name, size in sizes]  # float32: 4 bytes per element


def test_buckets_hold_whole_groups_under_the_bound():
    # Two layers of 3 x 40 bytes, an embedding of 200 bytes, a norm of 8 bytes; bound 100 bytes.
    sizes = [("model.embed_tokens.weight", 200)]
    sizes += [(f"model.layers.{i}.{part}.weight", 40) for i in range(2) for part in ("q", "k", "v")]
    sizes += [("model.norm.weight", 8)]
    buckets = [[name for name, _ in bucket] for bucket in bucketed(stream(sizes), bucket_bytes=130)]
    assert buckets == [
        ["model.embed_tokens.weight"],  # alone larger than the bound: sent on its own
        ["model.layers.0.q.weight", "model.layers.0.k.weight", "model.layers.0.v.weight"],
        ["model.layers.1.q.weight", "model.layers.1.k.weight", "model.layers.1.v.weight", "model.norm.weight"],
    ]
    # A bound below one layer still never splits it; a huge bound gives one bucket.
    assert [len(b) for b in bucketed(stream(sizes), bucket_bytes=1)] == [1, 3, 3, 1]
    assert [len(b) for b in bucketed(stream(sizes), bucket_bytes=1 << 30)] == [8]


def test_a_group_that_reappears_later_is_refused():
    sizes = [("model.layers.0.q.weight", 4), ("model.layers.1.q.weight", 4), ("model.layers.0.k.weight", 4)]
    with pytest.raises(ValueError, match="'model.layers.0.k.weight' belongs to group 'model.layers.0.'"):
        list(bucketed(stream(sizes), bucket_bytes=1 << 20))
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1, got 0"):
        list(bucketed(stream(sizes), bucket_bytes=0))


@pytest.mark.parametrize("tied", [True, False])
def test_sync_weights_streams_every_weight_once_in_bounded_buckets(tied):
    model = tiny_model("llama", tie_word_embeddings=tied)
    engine = RecordingEngine()
    layer_bytes = sum(tensor_bytes(p) for n, p in model.named_parameters() if n.startswith("model.layers.0."))
    metrics = sync_weights(model, engine, bucket_bytes=layer_bytes)
    sent = [name for call in engine.calls for name, _, _ in call]
    expected = [name for name, _ in model.named_parameters()]  # tied lm_head once, as the embedding
    assert sent == expected
    total = sum(tensor_bytes(p) for p in model.parameters())
    assert metrics["sync/bytes"] == total
    assert metrics["sync/buckets"] == len(engine.calls)
    embedding_bytes = tensor_bytes(model.get_input_embeddings().weight)
    assert metrics["sync/max_bucket_bytes"] == embedding_bytes  # the 49152 x 64 embedding is the largest unit
    for call in engine.calls:
        groups = {weight_group(name) for name, _, _ in call}
        assert sum(size for _, _, size in call) <= layer_bytes or len(groups) == 1
    assert metrics["sync/seconds"] >= metrics["sync/load_seconds"] >= 0


def test_sync_in_the_engines_dtype_moves_half_the_bytes_and_the_same_weights():
    """The engine holds bf16 weights: fp32 masters gathered in bf16 give it exactly what it would cast them to."""
    from rollout.hf_engine import HFEngine

    model = tiny_model("llama", seed=3)
    full, half = RecordingEngine(), RecordingEngine()
    full_metrics = sync_weights(model, full, bucket_bytes=1 << 20)
    half_metrics = sync_weights(model, half, bucket_bytes=1 << 20, dtype=torch.bfloat16)
    assert half_metrics["sync/bytes"] == full_metrics["sync/bytes"] / 2
    assert [name for call in half.calls for name, _, _ in call] == [name for call in full.calls for name, _, _ in call]
    copies = [tiny_model("llama", seed=5).to(torch.bfloat16) for _ in range(2)]
    for copy, dtype in zip(copies, (None, torch.bfloat16)):
        engine = HFEngine(copy, list(range(copy.config.vocab_size)), shared=False, eos_token_ids=[0])  # len() only
        sync_weights(model, engine, bucket_bytes=1 << 20, dtype=dtype)
    for (name, a), (_, b) in zip(copies[0].state_dict().items(), copies[1].state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(copies[1].lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
