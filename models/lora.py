"""LoRA through peft: adapters injected in place into a transformers causal LM, the base model as the free
reference (adapters disabled), merged weights W + scale * B @ A streamed under the base HF names for the
rollout engine, and checkpoints that hold the adapter (peft format) instead of the whole model.

Why `inject_adapter_in_model` rather than `get_peft_model`: the model stays the same LlamaForCausalLM /
Qwen3ForCausalLM object (no PeftModel wrapper and no "base_model.model." prefix), so FSDP2 still finds its
decoder layers (each layer's adapters are sharded with it), gradient checkpointing and the fused logprob
pass still work, and a base name is recovered by dropping ".base_layer". Parameter names become
`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight` [r, in], `...q_proj.lora_B.default.weight` [out, r].
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from models import checkpoint, fsdp

ADAPTER = "default"  # peft's adapter name; a model here carries exactly one adapter
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MERGED_DIR = "merged"
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
    if any(hasattr(parameter, "full_tensor") for parameter in model.parameters()):
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
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in modules.items() if isinstance(module, torch.nn.Linear)})
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


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


@contextlib.contextmanager
def disabled_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block the model computes exactly the base model (every adapted layer returns
    base_layer(x)): reference logprobs for the KL term without a second model. peft's switch also clears
    requires_grad of the adapters, so every flag is put back as it was on exit, even after an exception."""
    layers = _lora_layers(model)
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


def adapter_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter's full tensors under PeftModel's names ("base_model.model.<module>.lora_A.weight"), on
    every rank. Every rank must call it: only adapter tensors are gathered, not the base weights."""
    state = {}
    for name, tensor in fsdp.named_weights(model):
        if _is_adapter_name(name):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            state[_peft_name(name)] = full.detach().cpu().contiguous()
    if not state:
        raise ValueError("the model carries no LoRA adapter (apply_lora was not called)")
    return state


def _adapter_config(model: torch.nn.Module):
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    if config is None:
        raise ValueError("the model carries no LoRA adapter made by apply_lora (no peft_config)")
    return config


def save_adapter(directory: str | os.PathLike, model: torch.nn.Module) -> Path:
    """Write the adapter in peft's format (adapter_config.json + adapter_model.safetensors), loadable with
    `PeftModel.from_pretrained(base_model, directory)`. Every rank must call it; rank 0 writes."""
    directory = Path(directory)
    state = adapter_state_dict(model)
    if fsdp.rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        _adapter_config(model).save_pretrained(directory)
        save_file(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    fsdp.barrier()
    return directory


def save_merged(directory: str | os.PathLike, model: torch.nn.Module, tokenizer) -> Path:
    """Write the merged model as a plain HF directory (safetensors, config, generation config, tokenizer)
    that AutoModelForCausalLM.from_pretrained and vLLM load with no peft. Every rank must call it."""
    directory = Path(directory)
    is_rank0 = fsdp.rank() == 0
    weights = {name: tensor.cpu() for name, tensor in merged_state_dict(model) if is_rank0}
    if is_rank0:
        directory.mkdir(parents=True, exist_ok=True)
        checkpoint._write_model(directory, model, weights, tokenizer)
    fsdp.barrier()
    return directory


def _check_adapter(directory: Path, model: torch.nn.Module, state: dict[str, Tensor]) -> ValueError | None:
    """Names and shapes of the saved adapter against the model's; rank and alpha against its config."""
    expected = {_peft_name(name): tuple(tensor.shape)
                for name, tensor in fsdp.named_weights(model) if _is_adapter_name(name)}
    given = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if expected != given:
        missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
        wrong = [f"{name} {given[name]} (model {expected[name]})" for name in expected
                 if name in given and given[name] != expected[name]]
        return ValueError(f"{directory / ADAPTER_WEIGHTS} does not fit the model's adapter: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}, wrong shapes {wrong[:3]}")
    saved = json.loads((directory / ADAPTER_CONFIG).read_text())
    ours = _adapter_config(model)
    for key, value in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
        if saved.get(key) != value:
            return ValueError(f"{directory / ADAPTER_CONFIG}: {key}={saved.get(key)!r}, the model's adapter has {value!r}")
    return None


def _read_adapter(directory: Path, model: torch.nn.Module) -> tuple[dict[str, Tensor] | None, Exception | None]:
    """(adapter tensors, None) when `directory` holds an adapter that fits the model, else (None, error)."""
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (directory / name).is_file():
            return None, FileNotFoundError(f"{directory / name} not found: not an adapter directory")
    try:
        state = load_file(directory / ADAPTER_WEIGHTS)
    except Exception as error:  # safetensors raises its own error types for damaged files
        return None, ValueError(f"{directory / ADAPTER_WEIGHTS} is damaged ({error})")
    error = _check_adapter(directory, model, state)
    return (None, error) if error else (state, None)


@torch.no_grad()
def _copy_adapter(model: torch.nn.Module, state: dict[str, Tensor] | None) -> None:
    if fsdp.world_size() == 1:  # a plain copy of the adapter tensors, nothing gathered
        for name, tensor in fsdp.named_weights(model):
            if _is_adapter_name(name):
                tensor.copy_(state[_peft_name(name)])
        return
    # models.fsdp.load_full_weights scatters complete state dicts only, so rank 0 completes the adapter with
    # the current base weights: under FSDP that gathers the model to rank 0 once, as a checkpoint save does.
    full = fsdp.gather_to_rank0(model)
    if fsdp.rank() == 0:
        for name in full:
            if _is_adapter_name(name):
                full[name] = state[_peft_name(name)]
    fsdp.load_full_weights(model, full if fsdp.rank() == 0 else None)


def load_adapter(directory: str | os.PathLike, model: torch.nn.Module) -> None:
    """Copy a saved adapter (save_adapter's format) into a model prepared with the same apply_lora settings,
    plain or FSDP-sharded; every rank must call it. Names, shapes, rank and alpha are checked before
    anything is copied; the base weights are left as they are."""
    directory = Path(directory)
    state, error = _read_adapter(directory, model) if fsdp.rank() == 0 else (None, None)
    fsdp.raise_on_all_ranks(error)
    _copy_adapter(model, state)


def _write_lora(directory: Path, model: torch.nn.Module, tokenizer, *, merged_export: bool) -> None:
    save_adapter(directory, model)
    if fsdp.rank() == 0 and tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if merged_export:
        save_merged(directory / MERGED_DIR, model, tokenizer)


def _check_lora(directory: Path, model: torch.nn.Module, state: dict) -> tuple[dict[str, Tensor] | None, Exception | None]:
    if not state.get("lora"):
        return None, ValueError(f"{directory} is not a LoRA checkpoint (model.lora is set): resume it with LoRA off")
    return _read_adapter(directory, model)


def _lora_format(merged_export: bool = False) -> checkpoint.WeightsFormat:
    """The adapter (peft format) at the top level of a checkpoint, the tokenizer beside it, [merged/]."""
    return checkpoint.WeightsFormat(
        write=lambda directory, model, tokenizer: _write_lora(directory, model, tokenizer, merged_export=merged_export),
        read=_check_lora, load=lambda directory, model, adapter: _copy_adapter(model, adapter),
        noun="adapter", state={"lora": True})


def save_lora_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, tokenizer,
                         optimizer: torch.optim.Optimizer | None, step: int, rng: torch.Generator | None = None,
                         extra: dict | None = None, *, merged_export: bool = False) -> Path:
    """models.checkpoint.save_checkpoint for a LoRA model: the same atomic layout and resume state, but the
    adapter (peft format, at the top level: `PeftModel.from_pretrained(base, directory)` loads it) instead
    of the whole model, and with merged_export the merged HF model in `merged/`. Every rank must call it.
    Layout: adapter_config.json, adapter_model.safetensors, tokenizer files, [merged/], optimizer/, rng/,
    trainer_state.json (with "lora": true), COMPLETE (written last)."""
    return checkpoint.save_checkpoint(directory, model, tokenizer, optimizer, step, rng, extra,
                                      weights=_lora_format(merged_export))


def load_lora_checkpoint(directory: str | os.PathLike, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer | None = None, *,
                         rng: torch.Generator | None = None) -> tuple[int, dict]:
    """Restore what save_lora_checkpoint wrote into a model prepared exactly as for training (the same base
    weights, apply_lora with the same settings, sharded or not) and its optimizer; return (step, extra).
    Every rank must call it. Everything is checked before anything is loaded."""
    return checkpoint.load_checkpoint(directory, model, optimizer, rng=rng, weights=_lora_format())
