"""Training checkpoints that a resumed run continues from exactly: the model as an HF directory that transformers
and vLLM load as it is (for a LoRA model its adapter in peft's format instead, and on request the merged model),
the optimizer state (torch.distributed.checkpoint), per-rank RNG states and a small trainer-state JSON.

Layout of `step_<n>/`:
    model.safetensors, config.json, generation_config.json, tokenizer files     (rank 0)
    or, for a LoRA model: adapter_model.safetensors, adapter_config.json, tokenizer files, [merged/]
    optimizer/                 torch.distributed.checkpoint files             (every rank)
    rng/rank_<r>.safetensors   torch / CUDA / generator states; rng/rank_<r>.json: python and numpy states
    trainer_state.json         {"step", "world_size", "has_optimizer", "lora", "extra"}
    COMPLETE                   written last: {"step", "files": {relative path: size in bytes}}
Everything is written into a hidden sibling `.step_<n>.partial`, renamed into place once COMPLETE is written, so a
crash mid-save leaves nothing `latest_checkpoint` returns; a write that fails (a full disk, a file size limit)
removes its partial directory and raises CheckpointWriteError naming the path and the bytes needed. A load
checks everything it can before it changes anything.
"""
from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models import fsdp, lora

MARKER = "COMPLETE"
WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file names: PeftModel.from_pretrained reads the directory
ADAPTER_CONFIG = "adapter_config.json"
MERGED_DIR = "merged"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a file size limit, ...); its partial directory is gone and
    the checkpoints written before are untouched."""


def _hf_class_name(model: torch.nn.Module) -> str:
    # FSDP2 subclasses the model's class on the fly (FSDPLlamaForCausalLM); the config must name the HF one.
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def _write_model(directory: Path, model: torch.nn.Module, weights: dict, tokenizer) -> None:
    """An HF model directory holding `weights` (full CPU tensors under HF names) and `model`'s configs."""
    directory.mkdir(exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, directory / WEIGHTS,
              metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.architectures = [_hf_class_name(model)]
    config.use_cache = True  # training turns the KV cache off; generation from the export wants it on
    dtypes = {tensor.dtype for tensor in weights.values() if tensor.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _write_weights(directory: Path, model: torch.nn.Module, tokenizer, merged_export: bool) -> None:
    """Every rank: the whole model, or a LoRA model's adapter and tokenizer (and with merged_export the merged
    model in merged/, which transformers and vLLM load with no peft). Rank 0 writes what every rank gathers."""
    is_rank0 = fsdp.rank() == 0
    if not lora.is_lora(model):
        weights = {name: tensor.cpu() for name, tensor in fsdp.full_state_dict(model) if is_rank0}
        if is_rank0:
            _write_model(directory, model, weights, tokenizer)
        return
    adapter = lora.adapter_state_dict(model)
    merged = ({name: tensor.cpu() for name, tensor in lora.merged_state_dict(model) if is_rank0}
              if merged_export else None)
    if is_rank0:
        lora.adapter_config(model).save_pretrained(directory)
        save_file(adapter, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        if merged is not None:
            _write_model(directory / MERGED_DIR, model, merged, tokenizer)


def _rng_paths(directory: Path, rank: int) -> tuple[Path, Path]:
    return directory / "rng" / f"rank_{rank:05d}.safetensors", directory / "rng" / f"rank_{rank:05d}.json"


def _write_rng(directory: Path, rng: torch.Generator | None) -> None:
    tensor_path, json_path = _rng_paths(directory, fsdp.rank())
    tensor_path.parent.mkdir(exist_ok=True)
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"torch_cuda_{index}": state for index, state in enumerate(torch.cuda.get_rng_state_all())})
    if rng is not None:
        tensors["generator"] = rng.get_state()
    save_file(tensors, tensor_path)
    version, python_state, gauss = random.getstate()
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    json_path.write_text(json.dumps({
        "python": [version, list(python_state), gauss],
        "numpy": [name, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)],
    }))


def _restore_rng(directory: Path, rng: torch.Generator | None) -> None:
    tensor_path, json_path = _rng_paths(directory, fsdp.rank())
    tensors = load_file(tensor_path)
    states = json.loads(json_path.read_text())
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[f"torch_cuda_{index}"] for index in range(len(tensors)) if f"torch_cuda_{index}" in tensors]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    if rng is not None:
        if "generator" not in tensors:
            raise ValueError(f"{tensor_path} holds no generator state, but load_checkpoint was given rng=")
        rng.set_state(tensors["generator"])
    version, python_state, gauss = states["python"]
    random.setstate((version, tuple(python_state), gauss))
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)  # a file, or a directory (to make a rename in it durable)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _seal(partial: Path, final: Path, step: int, state: dict) -> None:
    """Rank 0: trainer state, fsync every file, the COMPLETE marker, then the rename into place (an existing
    `final` is moved aside first and deleted after)."""
    (partial / STATE).write_text(json.dumps({"step": int(step), **state}, indent=1) + "\n")
    files = {str(path.relative_to(partial)): path.stat().st_size
             for path in sorted(partial.rglob("*")) if path.is_file()}
    for relative in files:
        _fsync(partial / relative)
    (partial / MARKER).write_text(json.dumps({"step": int(step), "files": files}, indent=1) + "\n")
    _fsync(partial / MARKER)
    previous = final.parent / f".{final.name}.previous"
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(final, previous)
    os.rename(partial, final)
    _fsync(final.parent)
    shutil.rmtree(previous, ignore_errors=True)


def save_checkpoint(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    rng: torch.Generator | None = None,
    extra: dict | None = None,
    *,
    merged_export: bool = False,
) -> Path:
    """Write a complete checkpoint to `directory` (e.g. runs/x/checkpoints/step_10); every rank must call it.

    rng: a generator of the trainer's own to save besides the global torch / CUDA / python / numpy RNGs.
    extra: JSON-serialisable trainer state (data position, scheduler state, ...), returned by load_checkpoint.
    merged_export: for a LoRA model, also write the merged model to merged/.
    A write that fails on any rank (disk full, file too large) raises CheckpointWriteError on every rank, naming
    the path and the bytes needed, after the partial directory is removed; earlier checkpoints stay as they were.
    """
    final = Path(directory)
    partial = final.parent / f".{final.name}.partial"
    adapter = lora.is_lora(model)
    state = {"world_size": fsdp.world_size(), "has_optimizer": optimizer is not None, "lora": adapter,
             "extra": json.loads(json.dumps(extra if extra is not None else {}))}  # fails here if not JSON
    is_rank0 = fsdp.rank() == 0

    def fresh_directory() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir(parents=True)

    stages = [  # each ends with every rank learning whether any rank failed, so none waits in a collective
        ("the directory", lambda: fresh_directory() if is_rank0 else None),
        ("the adapter" if adapter else "the weights", lambda: _write_weights(partial, model, tokenizer, merged_export)),
        ("the optimizer state", lambda: optimizer is not None and fsdp.save_optimizer_state(
            str(partial / "optimizer"), model, optimizer)),
        ("the random number generator states", lambda: _write_rng(partial, rng)),
        ("the completion marker", lambda: _seal(partial, final, step, state) if is_rank0 else None),
    ]
    for what, stage in stages:
        error = None
        try:
            stage()
        except Exception as caught:  # OSError, safetensors' own error type, a DCP CheckpointException, ...
            error = caught
        failure = fsdp.first_error(error)
        if failure is not None:
            if is_rank0:
                shutil.rmtree(partial, ignore_errors=True)
            raise _write_error(final, what, failure, model, optimizer, adapter) from error
    return final


def _write_error(final: Path, what: str, failure: tuple[int, str], model, optimizer,
                 adapter: bool) -> CheckpointWriteError:
    # What a checkpoint needs, from the tensors' sizes (a DTensor shard counts as its whole tensor: every rank's
    # shards are written): the weights (the adapter alone for LoRA: the trainable ones) and the optimizer state.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not adapter)
    state_bytes = 0 if optimizer is None else sum(value.numel() * value.element_size()
                                                  for state in optimizer.state.values() for value in state.values()
                                                  if isinstance(value, torch.Tensor))
    rank, message = failure
    needed = weight_bytes + state_bytes
    free = shutil.disk_usage(final.parent).free if final.parent.exists() else 0
    return CheckpointWriteError(
        f"writing checkpoint {final} failed on rank {rank} while writing {what}: {message}. It needs about "
        f"{needed:,} bytes ({needed / 2**20:.1f} MiB: {weight_bytes:,} of {'adapter' if adapter else 'weights'} + "
        f"{state_bytes:,} of optimizer state); {free:,} bytes are free under {final.parent}. The partial directory "
        f"was removed; earlier checkpoints are intact")


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every complete `step_<n>` under run_dir/checkpoints (or run_dir itself when it has no
    checkpoints/ folder), by step. Partial saves are never listed."""
    root = Path(run_dir)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(match.group(1)), path) for path in root.iterdir()
                  if (match := _STEP_DIR.match(path.name)) and path.is_dir() and (path / MARKER).is_file())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete `step_<n>` directory with the largest n (complete_checkpoints); None when there is none."""
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


def _read_adapter(directory: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The saved adapter's tensors, once their names and shapes and the rank and alpha fit the model's adapter."""
    try:
        adapter = load_file(directory / ADAPTER_WEIGHTS)
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{directory / ADAPTER_WEIGHTS} is damaged ({error})") from None
    mismatch = fsdp.shape_mismatch({name: tuple(t.shape) for name, t in lora.adapter_weights(model)},
                                   {name: tuple(t.shape) for name, t in adapter.items()})
    if mismatch:
        raise ValueError(f"{directory / ADAPTER_WEIGHTS} does not fit the model's adapter: {mismatch}")
    saved, ours = json.loads((directory / ADAPTER_CONFIG).read_text()), lora.adapter_config(model)
    for key, value in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
        if saved.get(key) != value:
            raise ValueError(f"{directory / ADAPTER_CONFIG}: {key}={saved.get(key)!r}, "
                             f"the model's adapter has {value!r}")
    return adapter


def _verify(directory: Path, model: torch.nn.Module, optimizer) -> dict | None:
    """Rank 0, before anything is loaded: the marker, every listed file's size, the trainer state, then the
    weights' names and shapes against the model's (the tensors are read by the load, except the small
    adapter's). Returns the adapter's tensors for a LoRA model, else None; raises the first problem found."""
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not (directory / MARKER).is_file():
        raise ValueError(f"{directory} has no {MARKER} marker: it is a partial or interrupted save; resume "
                         "from latest_checkpoint(run_dir) instead")
    try:
        listed = json.loads((directory / MARKER).read_text())["files"]
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"{directory / MARKER} is damaged ({error}); resume from another checkpoint") from None
    for relative, size in listed.items():
        path = directory / relative
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file {path} is missing (listed in {directory / MARKER})")
        if path.stat().st_size != size:
            raise ValueError(f"checkpoint file {path} has {path.stat().st_size} bytes, {size} were written: "
                             "it is damaged")
    try:
        state = json.loads((directory / STATE).read_text())
    except (ValueError, OSError) as error:
        raise ValueError(f"{directory / STATE} is damaged ({error})") from None
    is_adapter = lora.is_lora(model)
    if is_adapter and not state.get("lora"):
        raise ValueError(f"{directory} is not a LoRA checkpoint (model.lora is set): resume it with LoRA off")
    if state.get("lora") and not is_adapter:
        raise ValueError(f"{directory} is a LoRA checkpoint (adapter only): resume it with model.lora on")
    adapter = None
    if is_adapter:
        adapter = _read_adapter(directory, model)
    else:
        with safe_open(directory / WEIGHTS, framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        mismatch = fsdp.shape_mismatch({name: tuple(t.shape) for name, t in fsdp.named_weights(model)}, shapes)
        if mismatch:
            raise ValueError(f"{directory / WEIGHTS} does not fit the model: {mismatch}")
    if optimizer is not None and not state.get("has_optimizer", False):
        raise ValueError(f"{directory} was saved without optimizer state; pass optimizer=None to load only the "
                         f"{'adapter' if is_adapter else 'weights'}")
    return adapter


def load_checkpoint(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: torch.Generator | None = None,
) -> tuple[int, dict]:
    """Restore the weights (a LoRA model: its adapter), optimizer state and RNG states from `directory` into a
    model prepared as for training (sharded or not); return (step, extra).

    Every rank must call it. The whole checkpoint is verified (marker, file sizes, weight names and shapes)
    before anything is loaded, and the optimizer is read into a copy first, so a damaged checkpoint raises
    without leaving the model or optimizer half-loaded.
    """
    directory = Path(directory)
    adapter_state, error = None, None
    if fsdp.rank() == 0:
        try:
            adapter_state = _verify(directory, model, optimizer)
        except Exception as caught:  # raised on every rank below, so no rank waits in a collective
            error = caught
    fsdp.raise_on_all_ranks(error)
    state = json.loads((directory / STATE).read_text())
    if optimizer is not None:
        fsdp.load_optimizer_state(str(directory / "optimizer"), model, optimizer)
    if lora.is_lora(model):
        lora.load_adapter_state(model, adapter_state)
    else:  # read only now: the weights are then not held while the optimizer state loads (through a copy)
        fsdp.load_full_weights(model, load_file(directory / WEIGHTS) if fsdp.rank() == 0 else None)
    if state["world_size"] == fsdp.world_size():
        _restore_rng(directory, rng)
    else:
        warnings.warn(f"{directory} was saved by {state['world_size']} ranks and is resumed by {fsdp.world_size()}: "
                      f"{'adapter' if state.get('lora') else 'weights'} and optimizer state are restored, random "
                      "number generator states are not")
    return int(state["step"]), state["extra"]
