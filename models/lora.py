"""LoRA through peft: adapters injected in place into a transformers causal LM, the base model as the free
reference (adapters disabled), merged weights W + scale * B @ A streamed under the base HF names for the
rollout engine, and the adapter's tensors for checkpoints (models.checkpoint writes them in peft's format).

Why `inject_adapter_in_model` rather than `get_peft_model`: the model stays the same LlamaForCausalLM /
Qwen3ForCausalLM object (no PeftModel wrapper and no "base_model.model." prefix), so FSDP2 still finds its
decoder layers (each layer's adapters are sharded with it), gradient checkpointing and the fused logprob
pass still work, and a base name is recovered by dropping ".base_layer". Parameter names become
`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight` [r, in], `...q_proj.lora_B.default.weight` [out, r].
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from models import checkpoint, fsdp

ADAPTER = "default"  # peft's adapter name; a model here carries exactly one adapter
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names adapter tensors


def _peft_name(name: str) -> str:
    """The peft file's name for one of our adapter parameters (no adapter-name level, peft's prefix)."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def apply_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
) -> torch.nn.Module:
    """Inject a LoRA adapter (B initialised to 0, so the model's outputs are unchanged) into every nn.Linear
    named by `target_modules` (a module matches "q_proj" when its name is "q_proj" or ends with ".q_proj",
    peft's rule); freeze everything else. Returns
    `model` itself. Call it on the plain model, after gradient checkpointing is enabled and BEFORE
    models.fsdp.shard. The optimizer then gets `[p for p in model.parameters() if p.requires_grad]`.

    rank: r of A [r, in] and B [out, r]; alpha: the update is scaled by alpha / r; dropout: on the adapter's
    input, active only in train mode; seed: A's random initialisation, drawn from its own generator so that
    every rank builds the same adapter and the global RNG is left untouched.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"model.lora.rank must be an integer >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"model.lora.alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.lora.dropout must be in [0, 1), got {dropout!r}")
    if isinstance(target_modules, str) or not target_modules:
        raise ValueError(f"model.lora.target_modules must be a non-empty list of module names, got {target_modules!r}")
    if is_lora(model):
        raise ValueError("apply_lora: the model already carries a LoRA adapter")
    if fsdp.is_sharded(model):
        raise ValueError("apply_lora: the model is already FSDP-sharded; apply LoRA before models.fsdp.shard")
    _check_targets(model, list(target_modules))
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        bias="none", base_model_name_or_path=getattr(model.config, "_name_or_path", None) or None)
    with torch.random.fork_rng(devices=[]):  # peft draws A on the CPU before moving it to the base's device
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(_is_adapter_name(name))
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
                # models.logprobs projects with lm_head.weight directly: an adapter there would be ignored.
                raise ValueError(f"model.lora.target_modules: {target!r} matches the output projection {name!r}, "
                                 "which LoRA here does not support (the fused logprob pass reads its weight directly)")
            if type(module) is not torch.nn.Linear:
                raise ValueError(f"model.lora.target_modules: {target!r} matches {name!r}, a {type(module).__name__}; "
                                 f"only nn.Linear modules are supported (its nn.Linear names: {linear})")


def _is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_lora(model: torch.nn.Module) -> bool:
    """True when `model` carries a peft LoRA adapter (apply_lora or PeftModel). Reads the peft_config that
    peft attaches, so a run without LoRA never imports peft."""
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


def merged_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Stream (base HF name, full tensor) of the model with every adapter merged, W + scale * B @ A, in the
    base model's order, e.g. ("model.layers.0.self_attn.q_proj.weight", [out, in]). The trained model is not
    modified: each merged tensor is computed on the fly from the gathered W, A and B (in fp32, returned in
    W's dtype). Every rank must consume the whole iterator (gathering an FSDP shard is a collective); the
    order is the fixed module order, the same on every rank. A model without adapters streams
    models.fsdp.full_state_dict unchanged.
    """
    if not is_lora(model):
        yield from fsdp.full_state_dict(model)
        return
    from peft.tuners.lora import LoraLayer

    # Names as models.fsdp streams them (wrapper prefixes such as torch.compile's "_orig_mod." dropped).
    scales = {fsdp._clean_name(name): module.scaling[ADAPTER] for name, module in model.named_modules()
              if isinstance(module, LoraLayer)}
    pending: dict[str, dict[str, Tensor]] = {}  # adapted module -> its tensors seen so far
    for name, tensor in fsdp.full_state_dict(model):
        module, part = _lora_part(name)
        if module is None:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if {"weight", "lora_A", "lora_B"} <= set(parts):
            weight, down, up = parts.pop("weight"), parts.pop("lora_A"), parts.pop("lora_B")
            merged = weight.float() + scales[module] * (up.float() @ down.float())
            yield f"{module}.weight", merged.to(weight.dtype)
            for leftover, value in sorted(parts.items()):  # the base layer's bias, if any
                yield f"{module}.{leftover}", value
            del pending[module]
    if pending:
        raise ValueError(f"merged_state_dict: adapted modules with missing tensors: {sorted(pending)[:5]}")


def _lora_part(name: str) -> tuple[str | None, str]:
    """"m.q_proj.base_layer.weight" -> ("m.q_proj", "weight"); "m.q_proj.lora_A.default.weight" ->
    ("m.q_proj", "lora_A"); a name outside any adapted layer -> (None, "")."""
    for tag in (".lora_A.", ".lora_B."):
        if tag in name:
            return name.split(tag)[0], tag.strip(".")
    if ".base_layer." in name:
        module, leaf = name.split(".base_layer.")
        return module, leaf
    return None, ""


def adapter_weights(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """(peft file name, parameter: a DTensor shard or a plain tensor) of every adapter tensor, in module order."""
    weights = [(_peft_name(name), tensor) for name, tensor in fsdp.named_weights(model) if _is_adapter_name(name)]
    if not weights:
        raise ValueError("the model carries no LoRA adapter (apply_lora was not called)")
    return weights


def adapter_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter's full tensors on the CPU under PeftModel's names ("base_model.model.<module>.lora_A.weight"),
    on every rank. Every rank must call it: only adapter tensors are gathered, not the base weights."""
    return {name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().contiguous()
            for name, tensor in adapter_weights(model)}


def adapter_config(model: torch.nn.Module):
    """The peft LoraConfig that apply_lora attached (its save_pretrained writes adapter_config.json)."""
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    if config is None:
        raise ValueError("the model carries no LoRA adapter made by apply_lora (no peft_config)")
    return config


def load_adapter_state(model: torch.nn.Module, state: dict[str, Tensor] | None) -> None:
    """Copy adapter tensors (adapter_state_dict's names, held by rank 0; None on the others) into the model,
    plain or FSDP-sharded; every rank must call it. The base weights are left as they are."""
    for name, tensor in adapter_weights(model):
        fsdp.copy_from_rank0(tensor, state[name] if fsdp.rank() == 0 else None)


# The names launch/ imports: models.checkpoint's save and load write and restore a LoRA model's adapter
# themselves. (models.checkpoint imports this module too; `checkpoint` is only read when these run.)
def save_lora_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, tokenizer,
                         optimizer: torch.optim.Optimizer | None, step: int, rng: torch.Generator | None = None,
                         extra: dict | None = None, *, merged_export: bool = False) -> Path:
    """models.checkpoint.save_checkpoint of a LoRA model: the adapter in peft's format, [merged/], the rest."""
    return checkpoint.save_checkpoint(directory, model, tokenizer, optimizer, step, rng, extra,
                                      merged_export=merged_export)


def load_lora_checkpoint(directory: str | os.PathLike, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer | None = None, *,
                         rng: torch.Generator | None = None) -> tuple[int, dict]:
    """models.checkpoint.load_checkpoint into a model prepared as for training (apply_lora with the same
    settings, sharded or not); returns (step, extra)."""
    return checkpoint.load_checkpoint(directory, model, optimizer, rng=rng)
