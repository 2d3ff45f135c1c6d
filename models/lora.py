"""LoRA through peft: adapters in a transformers causal LM, the base model as the free KL reference, merged weights
for the rollout engine (models.checkpoint writes the adapter in peft's format).

Why `inject_adapter_in_model` rather than `get_peft_model`: the model stays the same LlamaForCausalLM object (no
PeftModel wrapper, no "base_model.model." prefix), so FSDP2 still finds its decoder layers, gradient checkpointing
and the fused logprob pass still work, and a base name is recovered by dropping ".base_layer". Parameter names
become `...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight` [r, in], `...lora_B.default.weight` [out, r]."""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from models import fsdp

ADAPTER = "default"  # peft's adapter name; a model here carries exactly one adapter
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A tensor of an adapted layer: "m.q_proj.base_layer.weight" -> ("m.q_proj", "weight"), and
# "m.q_proj.lora_A.default.weight" -> ("m.q_proj", "lora_A").
_ADAPTED = re.compile(rf"(.+)\.(?:base_layer\.(\w+)|(lora_[AB])\.{ADAPTER}\.weight)")


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: Sequence[str] = DEFAULT_TARGETS, seed: int = 0) -> torch.nn.Module:
    """Inject a LoRA adapter (B initialised to 0, so the model's outputs are unchanged) into every nn.Linear
    named by `target_modules` (a module matches "q_proj" when its name is "q_proj" or ends with ".q_proj",
    peft's rule); freeze everything else and return `model`. Call it on the plain model, after gradient
    checkpointing is enabled and before models.fsdp.shard; the optimizer gets the parameters that require grad.
    rank: r of A [r, in] and B [out, r]; alpha: the update is scaled by alpha / r; dropout: on the adapter's
    input, in train mode only (grpo.config.LoraConfig checks the three ranges); seed: A's initialisation, from
    its own generator, so every rank builds the same adapter and the global RNG is left untouched.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if isinstance(target_modules, str) or not target_modules:
        raise ValueError(f"model.lora.target_modules must be a non-empty list of module names, got {target_modules!r}")
    if is_lora(model):
        raise ValueError("apply_lora: the model already carries a LoRA adapter")
    _check_targets(model, list(target_modules))
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        bias="none", base_model_name_or_path=getattr(model.config, "_name_or_path", None) or None)
    with torch.random.fork_rng(devices=[]):  # peft draws A on the CPU before moving it to the base's device
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)  # it also freezes all but the adapters
    return model


def _check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    modules = dict(model.named_modules())
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in modules.items()
                     if isinstance(module, torch.nn.Linear)})
    for target in targets:
        matched = [name for name in modules if name == target or name.endswith("." + target)]
        if not matched:
            raise ValueError(f"model.lora.target_modules: {target!r} matches no module of {type(model).__name__} "
                             f"(its nn.Linear names: {linear})")
        for name in matched:
            module = modules[name]
            if module is output:
                raise ValueError(f"model.lora.target_modules: {target!r} matches the output projection {name!r}, "
                                 "which LoRA here does not support (the fused logprob pass reads its weight directly)")
            if type(module) is not torch.nn.Linear:
                raise ValueError(f"model.lora.target_modules: {target!r} matches {name!r}, a {type(module).__name__}; "
                                 f"only nn.Linear modules are supported (its nn.Linear names: {linear})")


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` carries a peft LoRA adapter, from the peft_config peft attaches (no peft import)."""
    configs = getattr(model, "peft_config", None) or {}
    return any(getattr(config, "peft_type", None) == "LORA" for config in configs.values())


@contextlib.contextmanager
def disabled_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block the model computes exactly the base model (every adapted layer returns
    base_layer(x)): reference logprobs for the KL term without a second model. peft's switch also clears
    requires_grad of the adapters, so every flag is put back as it was on exit, even after an exception."""
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    if not layers:
        raise ValueError("disabled_adapters: the model carries no LoRA adapter (apply_lora was not called)")
    flags = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Stream (base HF name, full tensor) in the base model's order with every adapter merged, W + scale * B @ A
    (from the gathered W, A and B in fp32, returned in W's dtype; the model is not modified). Every rank must
    consume the whole iterator (as models.fsdp.full_state_dict's, which a model without adapters streams). dtype:
    floating tensors cast to it (a model without adapters gathers in it; a merge is computed first, then cast)."""
    if not is_lora(model):
        yield from fsdp.full_state_dict(model, dtype)
        return
    from peft.tuners.lora import LoraLayer

    scales = {name: module.scaling[ADAPTER] for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    pending: dict[str, dict[str, Tensor]] = {}  # adapted module -> its tensors seen so far
    for name, tensor in fsdp.full_state_dict(model):
        match = _ADAPTED.fullmatch(name)
        if match is None:
            yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
            continue
        module = match.group(1)
        parts = pending.setdefault(module, {})
        parts[match.group(2) or match.group(3)] = tensor
        if {"weight", "lora_A", "lora_B"} <= set(parts):
            weight, down, up = parts.pop("weight"), parts.pop("lora_A"), parts.pop("lora_B")
            merged = weight.float() + scales[module] * (up.float() @ down.float())
            yield f"{module}.weight", merged.to(dtype or weight.dtype)
            for leftover, value in sorted(parts.items()):  # the base layer's bias, if any
                yield f"{module}.{leftover}", value.to(dtype or value.dtype)
            del pending[module]
