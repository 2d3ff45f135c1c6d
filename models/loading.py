"""Load a causal LM and its tokenizer by a name resolve_model_dir accepts. Nothing here downloads: the machines
this project targets have no hub access, so a hub id that is not already cached fails with a message saying how
to point at a directory instead.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.constants import HF_HUB_CACHE

from models import embedded

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_model_dir(name_or_path: str | os.PathLike | None, *, need_weights: bool = True) -> Path:
    """A model name as a local HF directory (config.json + weights): None -> the embedded default; a directory ->
    itself, a LoRA checkpoint -> its merged model (models.checkpoint.merge_lora_checkpoint); a `.gguf` file -> its
    converted cache directory; `org/name` that is not a path -> its snapshot in the local Hugging Face cache.
    need_weights=False accepts a directory that holds only a tokenizer."""
    if name_or_path is None:
        return embedded.convert_gguf(embedded.embedded_gguf_path())
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return embedded.convert_gguf(path)
        raise ValueError(f"{path} is a file; pass a model directory (config.json + *.safetensors) or a .gguf file")
    # "org/name" with exactly one slash and no path syntax is a hub id; "./x", "/x", "~/x" and "a/b/c" are paths.
    if not path.exists() and text.count("/") == 1 and not text.startswith((".", "/", "~")) and all(text.split("/")):
        try:  # local_files_only: the HF_HUB_OFFLINE behaviour, whatever the environment says
            path = Path(snapshot_download(text, local_files_only=True))
        except (OSError, ValueError) as error:
            raise FileNotFoundError(
                f"{text!r} is neither a local path nor a model in the local Hugging Face cache ({HF_HUB_CACHE}); "
                "this project never downloads weights. Download it on a machine with network access "
                f"(`huggingface-cli download {text} --local-dir DIR`), copy DIR here and pass DIR as the model"
            ) from error
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} does not exist; pass a directory holding config.json and weights")
    if not need_weights:
        return path
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from models.checkpoint import merge_lora_checkpoint  # models.checkpoint imports this module

        return merge_lora_checkpoint(path)  # a LoRA checkpoint: its merged model
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json; pass a Hugging Face model directory (as written by save_pretrained)")
    if not any((path / name).is_file() for name in WEIGHT_FILES) and not list(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{path} has a config.json but no weights (expected one of {', '.join(WEIGHT_FILES)}); "
            "copy the weight files into it or point at a complete model directory")
    return path


def choose_attention(requested: str, device_type: str, compute_dtype: str, flash_attn: bool) -> str:
    """The attention implementation a model loads with. "auto": flash_attention_2 on CUDA where flash-attn is
    installed and the model computes in bf16/fp16 (flash-attn refuses fp32), else sdpa; anything else as asked.

    >>> choose_attention("auto", "cuda", "bfloat16", True), choose_attention("auto", "cuda", "float32", True)
    ('flash_attention_2', 'sdpa')
    """
    if requested != "auto":
        return requested
    if device_type == "cuda" and flash_attn and compute_dtype in ("bfloat16", "float16"):
        return "flash_attention_2"
    return "sdpa"


def resolve_attn_implementation(attn_implementation: str, device: str | torch.device,
                                compute_dtype: str | torch.dtype = "float32") -> str:
    """choose_attention on this machine: flash-attn counts as installed when it imports."""
    device_type = torch.device(device).type
    flash = device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    dtype = str(compute_dtype).removeprefix("torch.")
    return choose_attention(attn_implementation, device_type, dtype, flash)


def load_model(name_or_path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attn_implementation: str = "auto",
               gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a causal LM (AutoModelForCausalLM) onto `device` in `dtype`; see resolve_model_dir for names."""
    from transformers import AutoModelForCausalLM

    directory = resolve_model_dir(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=resolve_attn_implementation(attn_implementation, device, dtype),
        trust_remote_code=trust_remote_code, local_files_only=True)
    model.to(device)
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with inputs that do not require grad and with FSDP2.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def load_tokenizer(name_or_path: str | os.PathLike | None = None, *, trust_remote_code: bool = False):
    """Load the tokenizer of a model (see resolve_model_dir); it always has a pad token and a chat template."""
    from transformers import AutoTokenizer

    directory = resolve_model_dir(name_or_path, need_weights=False)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the model's "
                         f"tokenizer files into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load a tokenizer from {directory} (tokenizer.json / tokenizer_config.json "
                         f"missing or unreadable): {error}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {directory} has no eos_token; "
                         f"set one in {directory / 'tokenizer_config.json'}")
    if tokenizer.pad_token_id is None:
        # Padded positions are always masked out of attention and loss, so reusing EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {directory} has no chat template; every prompt here is a chat, so add one "
                         f"({directory / 'chat_template.jinja'} or 'chat_template' in tokenizer_config.json), "
                         "e.g. copied from the instruct variant of the same model")
    return tokenizer
