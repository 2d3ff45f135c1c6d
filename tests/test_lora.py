"""LoRA on one process with tiny random models: only adapters train, the disabled adapter is exactly the base
model, merged weights synced into an HF engine give the policy's logprobs, gradient checkpointing changes
nothing, and adapters round-trip through peft's format and through resumable checkpoints."""
from __future__ import annotations

import json
import zlib

import pytest
import torch

from models import fsdp, load_tokenizer
from launch.recipe import load_config
from models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from models.logprobs import completion_logprobs, pad_batch
from models.lora import apply_lora, disabled_adapters, is_lora, merged_state_dict
from tiny import tiny_model
from rollout.hf_engine import HFEngine
from rollout.sync import bucketed

VOCAB = 4096  # a small vocabulary keeps each step cheap; the layout is the same as at 49,152
RANK, ALPHA = 4, 8.0
PROMPTS = [[1, 504, 3458, 282], [1, 18, 19]]


def base_model(arch: str = "llama", tie: bool = True):
    return tiny_model(arch, tie_word_embeddings=tie, seed=3, vocab_size=VOCAB)


def lora_model(arch: str = "llama", tie: bool = True, **options):
    return with_adapter(base_model(arch, tie), **options)


def with_adapter(model, **options):
    """apply_lora, then a nonzero B (peft starts B at 0, which would make every merge a no-op)."""
    apply_lora(model, rank=RANK, alpha=ALPHA, **options)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def make_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (4, 6, 3)]
    completions = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (5, 2, 4)]
    return pad_batch(prompts, completions, pad_id=2)


def train_step(model, optimizer, seed: int) -> float:
    batch = make_batch(seed)
    logprobs, _ = completion_logprobs(model, batch)
    loss = -(logprobs * batch["completion_mask"]).sum() / batch["completion_mask"].sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def logprobs_of(model, seed: int = 0):
    with torch.no_grad():
        return completion_logprobs(model, make_batch(seed))[0]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.mark.parametrize("options, key, value", [
    (dict(rank=0), "model.lora.rank", "0"),
    (dict(rank=2.5), "model.lora.rank", "2.5"),
    (dict(alpha=0.0), "model.lora.alpha", "0.0"),
    (dict(dropout=1.0), "model.lora.dropout", "1.0"),
    (dict(target_modules=["q_proj", "qkv_proj"]), "model.lora.target_modules", "'qkv_proj'"),
    (dict(target_modules=["input_layernorm"]), "model.lora.target_modules", "LlamaRMSNorm"),
    (dict(target_modules=["lm_head"]), "model.lora.target_modules", "output projection"),
    (dict(target_modules="q_proj"), "model.lora.target_modules", "'q_proj'"),
])
def test_bad_settings_name_the_key_and_value(options, key, value):
    with pytest.raises(ValueError) as caught:
        if "target_modules" in options:  # checked against the model's modules
            apply_lora(base_model(tie=False), **{"rank": RANK, "alpha": ALPHA, **options})
        else:  # the ranges of rank, alpha and dropout: the recipe's schema (grpo.config.LoraConfig)
            load_config({"model": {"lora": {"enabled": True, **options}}})
    assert key in str(caught.value) and value in str(caught.value)


def test_applying_twice_is_refused():
    model = lora_model()
    with pytest.raises(ValueError, match="already carries a LoRA adapter"):
        apply_lora(model, rank=RANK, alpha=ALPHA)


def test_only_adapters_are_trainable_and_only_they_change():
    model = lora_model(target_modules=["q_proj", "down_proj"])
    assert is_lora(model) and not is_lora(base_model())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    # Per layer: q_proj A [4, 64] + B [64, 4], down_proj A [4, 128] + B [64, 4]; 2 layers.
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) == 2 * (4 * 64 + 64 * 4 + 4 * 128 + 64 * 4)
    assert trainable == {f"model.layers.{i}.{module}.lora_{ab}.default.weight" for i in range(2)
                         for module in ("self_attn.q_proj", "mlp.down_proj") for ab in "AB"}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # Weight decay would move every parameter the optimizer holds: it must hold the adapters only.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    train_step(model, optimizer, seed=1)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]) != (name in trainable), name


def test_new_adapter_leaves_the_model_unchanged_and_is_seeded():
    # B = 0 at initialisation: the adapted model is the base model until the first step.
    assert torch.equal(logprobs_of(apply_lora(base_model(), rank=RANK, alpha=ALPHA)), logprobs_of(base_model()))
    state = torch.get_rng_state()
    first = dict(apply_lora(base_model(), rank=RANK, alpha=ALPHA, seed=1).named_parameters())
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is not consumed
    again = dict(apply_lora(base_model(), rank=RANK, alpha=ALPHA, seed=1).named_parameters())
    other = dict(apply_lora(base_model(), rank=RANK, alpha=ALPHA, seed=2).named_parameters())
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], other[name])


@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen3", False)])
def test_disabled_adapters_give_exactly_the_base_model(arch, tie):
    model, base = lora_model(arch, tie), base_model(arch, tie)
    assert (logprobs_of(model) - logprobs_of(base)).abs().max() > 0.01  # the adapter matters
    flags = [p.requires_grad for p in model.parameters()]
    with disabled_adapters(model):
        assert torch.equal(logprobs_of(model), logprobs_of(base))
    assert [p.requires_grad for p in model.parameters()] == flags
    with pytest.raises(RuntimeError, match="inside"), disabled_adapters(model):
        raise RuntimeError("inside")
    assert [p.requires_grad for p in model.parameters()] == flags
    assert (logprobs_of(model) - logprobs_of(base)).abs().max() > 0.01  # adapters are back on
    with pytest.raises(ValueError, match="no LoRA adapter"), disabled_adapters(base):
        pass


@pytest.mark.parametrize("arch, tie", [("llama", True), ("qwen3", False)])
def test_merged_weights_are_w_plus_scaled_ba_under_base_names(arch, tie):
    model, base = lora_model(arch, tie), base_model(arch, tie)
    merged = list(merged_state_dict(model))
    assert [name for name, _ in merged] == [name for name, _ in fsdp.full_state_dict(base)]
    modules = dict(model.named_modules())
    base_weights = dict(fsdp.full_state_dict(base))
    for name, tensor in merged:
        module = modules.get(name.rsplit(".", 1)[0])
        if hasattr(module, "get_delta_weight"):  # peft's own formula as the reference
            expected = base_weights[name] + module.get_delta_weight("default")
            assert torch.allclose(tensor, expected, rtol=0, atol=1e-7), name
            assert module.scaling["default"] == ALPHA / RANK
        else:
            assert torch.equal(tensor, base_weights[name]), name
    # Without adapters the stream is models.fsdp.full_state_dict's.
    assert [(n, t.data_ptr()) for n, t in merged_state_dict(base)] == [(n, t.data_ptr()) for n, t in fsdp.full_state_dict(base)]
    # Nothing was merged in place: the model still holds W, and its outputs are unchanged.
    assert torch.equal(model.model.layers[0].self_attn.q_proj.base_layer.weight, base.model.layers[0].self_attn.q_proj.weight)


def test_merged_sync_makes_engine_logprobs_equal_the_policy(tokenizer):
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, optimizer, seed=2)
    engine = HFEngine(base_model().eval().requires_grad_(False), tokenizer, shared=False)
    options = dict(n=2, max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=0)

    def gap() -> float:
        completions = engine.generate(PROMPTS, **options)
        batch = pad_batch([c.prompt_ids for c in completions], [c.completion_ids for c in completions], pad_id=2)
        policy = logprobs_of_batch(model, batch)
        rollout = torch.zeros_like(policy)
        for row, completion in enumerate(completions):
            rollout[row, : len(completion.logprobs)] = torch.tensor(completion.logprobs)
        return float(((policy - rollout).abs() * batch["completion_mask"]).max())

    assert gap() > 1e-2  # before the sync the engine samples from the base model
    for bucket in bucketed(merged_state_dict(model), bucket_bytes=1 << 16):
        engine.update_weights(bucket)
    # The engine decodes with a KV cache, the policy recomputes whole sequences: float32 rounding, 1e-6 measured.
    assert gap() <= 1e-5


def logprobs_of_batch(model, batch):
    with torch.no_grad():
        return completion_logprobs(model, batch)[0]


def test_gradient_checkpointing_recomputes_and_changes_nothing():
    plain = lora_model()
    checkpointed = base_model()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()  # HF checkpoints only in train mode
    with_adapter(checkpointed)  # after enabling checkpointing, as launch/build.py's load_model does
    calls = []
    mlp = checkpointed.model.layers[0].mlp
    original = mlp.forward
    # Wrapping forward, not a forward hook: torch's checkpoint recomputes without firing module hooks.
    mlp.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    grads = []
    for model in (plain, checkpointed):
        batch = make_batch(4)
        logprobs, _ = completion_logprobs(model, batch)
        (-(logprobs * batch["completion_mask"]).sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert len(calls) == 2  # forward, then recomputed in backward
    assert sorted(grads[0]) == sorted(grads[1]) and all("lora_" in name for name in grads[0])
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=0, atol=1e-6), name


def test_adapter_round_trips_through_peft_format(tmp_path):
    from peft import PeftModel

    model = lora_model("qwen3", tie=False)
    adapter = save_checkpoint(tmp_path / "step_1", model, None, None, 1)  # the adapter at the top level
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    loaded = PeftModel.from_pretrained(base_model("qwen3", tie=False), adapter)
    assert torch.equal(logprobs_of(loaded.base_model.model), logprobs_of(model))
    fresh = apply_lora(base_model("qwen3", tie=False), rank=RANK, alpha=ALPHA)
    load_checkpoint(adapter, fresh)
    assert torch.equal(logprobs_of(fresh), logprobs_of(model))
    mismatched = apply_lora(base_model("qwen3", tie=False), rank=RANK, alpha=2 * ALPHA)
    with pytest.raises(ValueError, match="lora_alpha"):
        load_checkpoint(adapter, mismatched)
    narrower = apply_lora(base_model("qwen3", tie=False), rank=RANK, alpha=ALPHA, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="does not fit"):
        load_checkpoint(adapter, narrower)


def test_merged_export_loads_in_plain_transformers(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = lora_model()
    directory = save_checkpoint(tmp_path / "step_1", model, tokenizer, None, 1, merged_export=True)
    exported = AutoModelForCausalLM.from_pretrained(directory / "merged", local_files_only=True)
    assert not is_lora(exported) and exported.config.architectures == ["LlamaForCausalLM"]
    assert (logprobs_of(exported) - logprobs_of(model)).abs().max() <= 1e-5


def test_a_lora_checkpoint_loads_as_a_model_merged_on_first_use(tmp_path, tokenizer):
    """init_from, launch.eval and vLLM load a LoRA checkpoint written without merged_export: the adapter is merged
    into the base model adapter_config.json names (or `base`), once, into merged/ (on 5cd6fe9: "has no config.json")."""
    from models import load_model, resolve_model_dir
    from models.checkpoint import merge_lora_checkpoint

    base_model("qwen3", tie=False).save_pretrained(tmp_path / "base")
    model = with_adapter(load_model(tmp_path / "base"))
    directory = save_checkpoint(tmp_path / "step_1", model, tokenizer, None, 1)
    assert not (directory / "merged").exists()
    assert resolve_model_dir(directory) == directory / "merged"
    assert (logprobs_of(load_model(directory)) - logprobs_of(model)).abs().max() <= 1e-5
    assert merge_lora_checkpoint(directory) == directory / "merged"  # already merged: the same directory
    orphan = save_checkpoint(tmp_path / "step_2", lora_model("qwen3", tie=False), tokenizer, None, 2)
    with pytest.raises(ValueError, match="names no base model: merge it with models.checkpoint.merge_lora_checkpoint"):
        merge_lora_checkpoint(orphan)
    assert merge_lora_checkpoint(orphan, tmp_path / "base") == orphan / "merged"
    assert (orphan / "merged" / "config.json").is_file()


def test_lora_checkpoint_resumes_exactly(tmp_path, tokenizer):
    def new_run(adapter_seed: int):
        model = apply_lora(base_model("qwen3", tie=False), rank=RANK, alpha=ALPHA, seed=adapter_seed)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    model, optimizer = new_run(0)
    uninterrupted = [train_step(model, optimizer, seed) for seed in range(4)]
    model, optimizer = new_run(0)
    resumed = [train_step(model, optimizer, seed) for seed in range(2)]
    directory = save_checkpoint(tmp_path / "checkpoints" / "step_2", model, tokenizer, optimizer, 2,
                                extra={"position": 6}, merged_export=True)
    assert latest_checkpoint(tmp_path) == directory
    assert not (directory / "model.safetensors").exists()  # the adapter, not the whole model
    assert load_tokenizer(directory).chat_template == tokenizer.chat_template
    model, optimizer = new_run(9)  # a different adapter until the checkpoint is loaded
    assert load_checkpoint(directory, model, optimizer) == (2, {"position": 6})
    resumed += [train_step(model, optimizer, seed) for seed in range(2, 4)]
    assert resumed == uninterrupted  # bit for bit
    with pytest.raises(ValueError, match="not a LoRA checkpoint"):
        (directory / "trainer_state.json").write_text(json.dumps({"step": 2, "world_size": 1, "extra": {}}))
        _fix_marker(directory)
        load_checkpoint(directory, model, optimizer)



def test_lora_checkpoint_is_verified_before_loading(tmp_path):
    saved_model = lora_model("qwen3", tie=False)
    directory = save_checkpoint(tmp_path / "step_1", saved_model, None, None, 1)
    model = apply_lora(base_model("qwen3", tie=False), rank=RANK, alpha=ALPHA, seed=5)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="without optimizer state; pass optimizer=None to load only the adapter"):
        load_checkpoint(directory, model, optimizer)
    with pytest.raises(ValueError, match="is a LoRA checkpoint"):  # a model without LoRA refuses an adapter
        load_checkpoint(directory, base_model("qwen3", tie=False))
    path = directory / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="adapter_model.safetensors has .* bytes.*damaged"):
        load_checkpoint(directory, model)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not optimizer.state


def _fix_marker(directory):
    marker = json.loads((directory / "COMPLETE").read_text())
    marker["files"]["trainer_state.json"] = (directory / "trainer_state.json").stat().st_size
    marker["crc32"]["trainer_state.json"] = zlib.crc32((directory / "trainer_state.json").read_bytes())
    (directory / "COMPLETE").write_text(json.dumps(marker))
