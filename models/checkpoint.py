"""Training checkpoints: an HF-format model directory (safetensors, config, generation config, tokenizer) that
transformers and vLLM load as it is, plus optimizer state (torch.distributed.checkpoint), per-rank RNG state
and a small trainer-state JSON, so that a resumed run continues exactly.

A checkpoint is written into a hidden temporary sibling directory and renamed into place after a completion
marker (listing every file and its size) is written last; a crash mid-save leaves at most a hidden partial
directory that `latest_checkpoint` never returns; a write that fails (a full disk, a file size limit) removes its
partial directory and raises CheckpointWriteError naming the path and the bytes needed. Layout of `step_<n>/`:
    model.safetensors, config.json, generation_config.json, tokenizer files   (rank 0)
    optimizer/                 torch.distributed.checkpoint files             (every rank)
    rng/rank_<r>.safetensors   torch / CUDA / generator states; rng/rank_<r>.json: python and numpy states
    trainer_state.json         {"step", "world_size", "has_optimizer", "extra"} and WeightsFormat.state
    COMPLETE                   written last: {"step", "files": {relative path: size in bytes}}
What stands for the weights is a WeightsFormat: the whole HF model by default; models.lora passes one that
writes the adapter instead, and shares everything else (atomic write, marker, verification, optimizer, RNG).
"""
from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models import fsdp

MARKER = "COMPLETE"
WEIGHTS = "model.safetensors"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _hf_class_name(model: torch.nn.Module) -> str:
    # FSDP2 subclasses the model's class on the fly (FSDPLlamaForCausalLM); the config must name the HF one.
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def _write_model(directory: Path, model: torch.nn.Module, weights: dict, tokenizer) -> None:
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, directory / WEIGHTS, metadata={"format": "pt"})
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


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@dataclass(frozen=True)
class WeightsFormat:
    """What a checkpoint stores for the model, and how it is written, checked and loaded back.

    write(directory, model, tokenizer): every rank calls it, into the hidden partial directory.
    read(directory, model, state) -> (payload, error): rank 0 only, after the marker and file sizes are
        verified (state: trainer_state.json); checks that the stored weights fit the model, loads nothing
        into it, and returns an error instead of raising so that every rank can raise it together.
    load(directory, model, payload): every rank; payload is read's on rank 0, None on the others.
    noun: what the weights are called in messages; state: extra trainer_state.json fields, e.g. {"lora": True}.
    """
    write: Callable[[Path, torch.nn.Module, Any], None]
    read: Callable[[Path, torch.nn.Module, dict], tuple[Any, Exception | None]]
    load: Callable[[Path, torch.nn.Module, Any], None]
    noun: str = "weights"
    state: dict = field(default_factory=dict)


def _write_full_model(directory: Path, model: torch.nn.Module, tokenizer) -> None:
    weights = fsdp.gather_to_rank0(model)
    if fsdp.rank() == 0:
        _write_model(directory, model, weights, tokenizer)


def _check_full_model(directory: Path, model: torch.nn.Module, state: dict) -> tuple[None, Exception | None]:
    """Weight names and shapes against the model's; the tensors themselves are read only by the load."""
    if state.get("lora"):
        return None, ValueError(f"{directory} is a LoRA checkpoint (adapter only): resume it with model.lora on")
    with safe_open(directory / WEIGHTS, framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    expected = fsdp.expected_shapes(model)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [f"{name} {shapes[name]} (model {expected[name]})" for name in expected if name in shapes and shapes[name] != expected[name]]
    if missing or unexpected or wrong:
        return None, ValueError(f"{directory / WEIGHTS} does not fit the model: missing {missing[:5]}, unexpected "
                                f"{unexpected[:5]}, wrong shapes {wrong[:5]}")
    return None, None


def _load_full_model(directory: Path, model: torch.nn.Module, payload: None) -> None:
    # Read here, not in read(): the weights are then not held while the optimizer state loads (through a copy).
    fsdp.load_full_weights(model, load_file(directory / WEIGHTS) if fsdp.rank() == 0 else None)


FULL_MODEL = WeightsFormat(write=_write_full_model, read=_check_full_model, load=_load_full_model)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a file size limit, ...); its partial directory is gone and
    the checkpoints written before are untouched."""


def estimated_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, weights: WeightsFormat) -> tuple[int, int]:
    """(weight bytes, optimizer-state bytes) a checkpoint needs, from the tensors' sizes (a DTensor shard counts as
    its whole tensor: every rank's shards together are written). The adapter alone for LoRA (trainable weights)."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if weights is FULL_MODEL or p.requires_grad)
    state_bytes = 0 if optimizer is None else sum(value.numel() * value.element_size()
                                                  for state in optimizer.state.values() for value in state.values()
                                                  if isinstance(value, torch.Tensor))
    return weight_bytes, state_bytes


def _fresh_directory(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
    partial.mkdir(parents=True)


def _seal(partial: Path, final: Path, step: int, extra_json: str, weights: WeightsFormat, has_optimizer: bool) -> None:
    """Rank 0: trainer state, fsync every file, then the COMPLETE marker, then the rename into place."""
    state = {"step": int(step), "world_size": fsdp.world_size(), "has_optimizer": has_optimizer, **weights.state}
    (partial / STATE).write_text(json.dumps({**state, "extra": json.loads(extra_json)}, indent=1) + "\n")
    files = {str(path.relative_to(partial)): path.stat().st_size for path in sorted(partial.rglob("*")) if path.is_file()}
    for relative in files:
        _fsync_file(partial / relative)
    (partial / MARKER).write_text(json.dumps({"step": int(step), "files": files}, indent=1) + "\n")
    _fsync_file(partial / MARKER)
    _replace_directory(partial, final)


def save_checkpoint(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    rng: torch.Generator | None = None,
    extra: dict | None = None,
    *,
    weights: WeightsFormat = FULL_MODEL,
) -> Path:
    """Write a complete checkpoint to `directory` (e.g. runs/x/checkpoints/step_10); every rank must call it.

    rng: a generator of the trainer's own to save besides the global torch / CUDA / python / numpy RNGs.
    extra: JSON-serialisable trainer state (data position, scheduler state, ...), returned by load_checkpoint.
    weights: what is written for the model (the whole HF model unless models.lora asks for its adapter).
    A write that fails on any rank (disk full, file too large) raises CheckpointWriteError on every rank, naming
    the path and the bytes needed, after the partial directory is removed; earlier checkpoints stay as they were.
    """
    final = Path(directory)
    partial = final.parent / f".{final.name}.partial"
    extra_json = json.dumps(extra if extra is not None else {})  # fail before writing if not serialisable
    is_rank0 = fsdp.rank() == 0
    stages = [  # each ends with every rank learning whether any rank failed, so none waits in a collective
        ("the directory", lambda: _fresh_directory(partial) if is_rank0 else None),
        (f"the {weights.noun}", lambda: weights.write(partial, model, tokenizer)),
        ("the optimizer state", lambda: optimizer is not None and fsdp.save_optimizer_state(
            str(partial / "optimizer"), model, optimizer)),
        ("the random number generator states", lambda: _write_rng(partial, rng)),
        ("the completion marker", lambda: _seal(partial, final, step, extra_json, weights, optimizer is not None) if is_rank0 else None),
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
            raise _write_error(final, what, failure, estimated_bytes(model, optimizer, weights), weights) from error
    return final


def _write_error(final: Path, what: str, failure: tuple[int, str], sizes: tuple[int, int],
                 weights: WeightsFormat) -> CheckpointWriteError:
    rank, message = failure
    needed = sum(sizes)
    free = shutil.disk_usage(final.parent).free if final.parent.exists() else 0
    return CheckpointWriteError(
        f"writing checkpoint {final} failed on rank {rank} while writing {what}: {message}. It needs about "
        f"{needed:,} bytes ({needed / 2**20:.1f} MiB: {sizes[0]:,} of {weights.noun} + {sizes[1]:,} of optimizer "
        f"state); {free:,} bytes are free under {final.parent}. The partial directory was removed; earlier "
        f"checkpoints are intact")


def _replace_directory(partial: Path, final: Path) -> None:
    previous = final.parent / f".{final.name}.previous"
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(final, previous)
    os.rename(partial, final)
    descriptor = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)  # make the rename itself durable
    finally:
        os.close(descriptor)
    shutil.rmtree(previous, ignore_errors=True)


def is_complete(directory: str | os.PathLike) -> bool:
    return (Path(directory) / MARKER).is_file()


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every complete `step_<n>` under run_dir/checkpoints (or run_dir itself when it has no
    checkpoints/ folder), by step. Partial saves are never listed."""
    root = Path(run_dir)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(match.group(1)), path) for path in root.iterdir()
                  if (match := _STEP_DIR.match(path.name)) and path.is_dir() and is_complete(path))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete `step_<n>` directory with the largest n (complete_checkpoints); None when there is none."""
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


def _verify(directory: Path, model: torch.nn.Module, optimizer, weights: WeightsFormat) -> tuple[Any, Exception | None]:
    """Everything that can be checked before loading: marker, file sizes, trainer state, then the weights
    (weights.read). Returns (weights.read's payload, None) or (None, the first error found)."""
    if not directory.is_dir():
        return None, FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not is_complete(directory):
        return None, ValueError(f"{directory} has no {MARKER} marker: it is a partial or interrupted save; resume "
                                "from latest_checkpoint(run_dir) instead")
    try:
        listed = json.loads((directory / MARKER).read_text())["files"]
    except (ValueError, KeyError, OSError) as error:
        return None, ValueError(f"{directory / MARKER} is damaged ({error}); resume from another checkpoint")
    for relative, size in listed.items():
        path = directory / relative
        if not path.is_file():
            return None, FileNotFoundError(f"checkpoint file {path} is missing (listed in {directory / MARKER})")
        if path.stat().st_size != size:
            return None, ValueError(f"checkpoint file {path} has {path.stat().st_size} bytes, {size} were written: it is damaged")
    try:
        state = json.loads((directory / STATE).read_text())
    except (ValueError, OSError) as error:
        return None, ValueError(f"{directory / STATE} is damaged ({error})")
    payload, error = weights.read(directory, model, state)
    if error is None and optimizer is not None and not state.get("has_optimizer", False):
        error = ValueError(f"{directory} was saved without optimizer state; pass optimizer=None to load only the {weights.noun}")
    return (None, error) if error else (payload, None)


def load_checkpoint(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: torch.Generator | None = None,
    weights: WeightsFormat = FULL_MODEL,
) -> tuple[int, dict]:
    """Restore model weights, optimizer state and RNG states from `directory`; return (step, extra).

    Every rank must call it. The whole checkpoint is verified (marker, file sizes, weight names and shapes)
    before anything is loaded, and the optimizer is read into a copy first, so a damaged checkpoint raises
    without leaving the model or optimizer half-loaded. weights: as given to save_checkpoint.
    """
    directory = Path(directory)
    payload, error = _verify(directory, model, optimizer, weights) if fsdp.rank() == 0 else (None, None)
    fsdp.raise_on_all_ranks(error)
    state = json.loads((directory / STATE).read_text())
    if optimizer is not None:
        fsdp.load_optimizer_state(str(directory / "optimizer"), model, optimizer)
    weights.load(directory, model, payload)
    if state["world_size"] == fsdp.world_size():
        _restore_rng(directory, rng)
    else:
        warnings.warn(f"{directory} was saved by {state['world_size']} ranks and is resumed by {fsdp.world_size()}: "
                      f"{weights.noun} and optimizer state are restored, random number generator states are not")
    return int(state["step"]), state["extra"]
