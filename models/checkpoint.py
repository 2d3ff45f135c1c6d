"""Training checkpoints that a resumed run continues from exactly: the model as an HF directory that transformers
and vLLM load as it is (for a LoRA model its adapter in peft's format instead, and on request the merged model),
the optimizer state (torch.distributed.checkpoint), per-rank RNG states and a small trainer-state JSON.

Layout of `step_<n>/`:
    model.safetensors, config.json, generation_config.json, tokenizer files     (rank 0)
    or, for a LoRA model: adapter_model.safetensors, adapter_config.json, tokenizer files, [merged/]
    optimizer/                 torch.distributed.checkpoint files             (every rank)
    rng/rank_<r>.safetensors   torch / CUDA states; python and numpy states in its metadata
    trainer_state.json         {"step", "world_size", "has_optimizer", "lora", "extra"}
    COMPLETE                   written last: {"step", "files": {path: bytes}, "crc32": {path: CRC-32}}
Everything is written into a hidden sibling `.step_<n>.partial` and renamed into place once COMPLETE is written,
so a crash mid-save leaves nothing `latest_checkpoint` returns; a load checks it all before it changes anything."""
from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models import fsdp, lora
from models.loading import load_model, load_tokenizer

MARKER = "COMPLETE"
WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file names: PeftModel.from_pretrained reads the directory
ADAPTER_CONFIG = "adapter_config.json"
MERGED_DIR = "merged"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a file size limit, ...): the message names the path and the
    bytes needed; its partial directory is gone and the checkpoints written before are untouched."""


def _trained_weights(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """What a checkpoint holds of the model, as (file name, parameter: a DTensor shard or a plain tensor) in
    module order, and the file: every weight, or a LoRA model's adapter tensors under PeftModel's names
    ("base_model.model.<module>.lora_A.weight")."""
    if not lora.is_lora(model):
        return fsdp.named_weights(model), WEIGHTS
    return [("base_model.model." + name.replace(f".{lora.ADAPTER}.", "."), tensor)
            for name, tensor in fsdp.named_weights(model) if re.search(r"\.lora_[AB]\.", name)], ADAPTER_WEIGHTS


def _write_weights(directory: Path, model: torch.nn.Module, tokenizer, merged_export: bool) -> None:
    """Every rank gathers, rank 0 writes the model or a LoRA model's adapter (only its tensors are gathered)."""
    if not lora.is_lora(model):
        return _write_model(directory, model, tokenizer)
    weights = {name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().contiguous()
               for name, tensor in _trained_weights(model)[0]}
    if fsdp.rank() == 0:
        model.peft_config[lora.ADAPTER].save_pretrained(directory)
        save_file(weights, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    if merged_export:
        _write_model(directory / MERGED_DIR, model, tokenizer)


def _write_model(directory: Path, model: torch.nn.Module, tokenizer) -> None:
    """The model (a LoRA model merged) as an HF directory that transformers and vLLM load; rank 0 writes."""
    weights = {name: tensor.cpu().contiguous() for name, tensor in lora.merged_state_dict(model) if fsdp.rank() == 0}
    if fsdp.rank() != 0:
        return
    directory.mkdir(exist_ok=True)
    save_file(weights, directory / WEIGHTS, metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    # FSDP2 subclasses the model's class on the fly (FSDPLlamaForCausalLM); the config must name the HF one.
    names = [cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers.")]
    config.architectures = [next((name for name in names if not name.startswith("FSDP")), type(model).__name__)]
    config.use_cache = True  # training turns the KV cache off; generation from the export wants it on
    dtypes = {tensor.dtype for tensor in weights.values() if tensor.is_floating_point()}
    if len(dtypes) == 1:
        config.dtype = next(iter(dtypes))
    config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def merge_lora_checkpoint(directory: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """A LoRA checkpoint as a model: its adapter merged into the base model, written once to directory/merged (an
    HF directory for init_from, launch.eval and vLLM) and returned. base: the base model, by default the one
    adapter_config.json names (the model the run trained from, as it was loaded)."""
    directory = Path(directory)
    merged = directory / MERGED_DIR
    if (merged / WEIGHTS).is_file():
        return merged
    check_files(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    base = base or config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{directory / ADAPTER_CONFIG} names no base model: merge it with models.checkpoint."
                         f"merge_lora_checkpoint('{directory}', base=MODEL)")
    model = lora.apply_lora(load_model(base), rank=config["r"], alpha=config["lora_alpha"],
                            target_modules=sorted(config["target_modules"]))
    fsdp.load_full_weights(_trained_weights(model)[0], load_file(directory / ADAPTER_WEIGHTS))
    partial = directory / f".{MERGED_DIR}.{os.getpid()}.partial"  # each process its own (torchrun ranks)
    shutil.rmtree(partial, ignore_errors=True)
    _write_model(partial, model, load_tokenizer(directory))
    try:
        os.rename(partial, merged)
    except OSError:  # another process was first: its merged/ is the same
        shutil.rmtree(partial)
    return merged


def _rng_path(directory: Path) -> Path:
    return directory / "rng" / f"rank_{fsdp.rank():05d}.safetensors"


def _write_rng(directory: Path) -> None:
    path = _rng_path(directory)
    path.parent.mkdir(exist_ok=True)
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors.update({f"torch_cuda_{index}": state for index, state in enumerate(torch.cuda.get_rng_state_all())})
    name, keys, *numpy_rest = np.random.get_state()  # keys: a uint32 array; the rest plain ints and a float
    save_file(tensors, path, metadata={"python": json.dumps(random.getstate()),
                                       "numpy": json.dumps([name, keys.tolist(), *numpy_rest])})


def _restore_rng(directory: Path) -> None:
    with safe_open(_rng_path(directory), framework="pt") as handle:
        states, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[f"torch_cuda_{index}"] for index in range(len(tensors)) if f"torch_cuda_{index}" in tensors]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    version, python_state, gauss = json.loads(states["python"])
    random.setstate((version, tuple(python_state), gauss))
    name, keys, *numpy_rest = json.loads(states["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *numpy_rest))


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)  # a file, or a directory (to make a rename in it durable)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _crc32(path: Path) -> int:
    checksum = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(16 << 20):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


def _seal(partial: Path, final: Path, step: int, state: dict) -> None:
    """Rank 0: trainer state, fsync every file, the COMPLETE marker, then the rename into place (an existing
    `final` is moved aside first and deleted after)."""
    (partial / STATE).write_text(json.dumps({"step": int(step), **state}, indent=1) + "\n")
    files = {str(path.relative_to(partial)): path.stat().st_size
             for path in sorted(partial.rglob("*")) if path.is_file()}
    for relative in files:
        _fsync(partial / relative)
    checksums = {relative: _crc32(partial / relative) for relative in files}
    (partial / MARKER).write_text(json.dumps({"step": int(step), "files": files, "crc32": checksums}, indent=1) + "\n")
    _fsync(partial / MARKER)
    previous = final.parent / f".{final.name}.previous"
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(final, previous)
    os.rename(partial, final)
    _fsync(final.parent)
    shutil.rmtree(previous, ignore_errors=True)


def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, tokenizer,
                    optimizer: torch.optim.Optimizer | None, step: int, extra: dict | None = None, *,
                    merged_export: bool = False) -> Path:
    """Write a complete checkpoint to `directory` (e.g. runs/x/checkpoints/step_10); every rank must call it, and a
    write that fails on any rank raises CheckpointWriteError on every rank. extra: JSON-serialisable trainer state
    (data position, ...), returned by load_checkpoint; merged_export: a LoRA model's merged model to merged/ too."""
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
        ("the random number generator states", lambda: _write_rng(partial)),
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
    tensors = [p for p in model.parameters() if p.requires_grad or not adapter]
    if optimizer is not None:
        tensors += [value for state in optimizer.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor)]
    needed = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    free = shutil.disk_usage(final.parent).free if final.parent.exists() else 0
    return CheckpointWriteError(
        f"writing checkpoint {final} failed on rank {failure[0]} while writing {what}: {failure[1]}. It needs about "
        f"{needed:,} bytes ({needed / 2**20:.1f} MiB of {'adapter' if adapter else 'weights'} and optimizer state); "
        f"{free:,} bytes are free under {final.parent}. The partial directory was removed; earlier checkpoints are "
        "intact")


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every complete `step_<n>` under run_dir/checkpoints (else run_dir itself), by step."""
    root = Path(run_dir)
    if (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(match.group(1)), path) for path in root.iterdir()
                  if (match := _STEP_DIR.match(path.name)) and path.is_dir() and (path / MARKER).is_file())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete `step_<n>` directory with the largest n (complete_checkpoints); None when there is none."""
    return max(complete_checkpoints(run_dir), default=(None, None))[1]


def check_files(directory: Path) -> dict:
    """Check the marker and every file it lists (size and CRC-32 as written); returns the trainer state."""
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    if not (directory / MARKER).is_file():
        raise ValueError(f"{directory} has no {MARKER} marker: it is a partial or interrupted save; resume "
                         "from latest_checkpoint(run_dir) instead")
    try:
        marker = json.loads((directory / MARKER).read_text())
        listed, checksums = marker["files"], marker["crc32"]
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"{directory / MARKER} is damaged ({error}); resume from another checkpoint") from None
    for relative, size in listed.items():
        path = directory / relative
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file {path} is missing (listed in {directory / MARKER})")
        if path.stat().st_size != size:
            raise ValueError(f"checkpoint file {path} has {path.stat().st_size} bytes, {size} were written: "
                             "it is damaged")
        if _crc32(path) != checksums.get(relative):
            raise ValueError(f"checkpoint file {path} is damaged: its CRC-32 differs from the one written in "
                             f"{directory / MARKER}")
    return json.loads((directory / STATE).read_text())


def _verify(directory: Path, model: torch.nn.Module, optimizer) -> None:
    """Rank 0, before anything is loaded: check_files, the weights' names and shapes (from the file's header)
    against the model's, and a LoRA adapter's rank and alpha; raises the first problem found."""
    state = check_files(directory)
    is_adapter = lora.is_lora(model)
    if is_adapter != bool(state.get("lora")):
        raise ValueError(f"{directory} is {'not a' if is_adapter else 'a'} LoRA checkpoint: resume it with "
                         f"model.lora {'off' if is_adapter else 'on'}")
    weights, file = _trained_weights(model)
    with safe_open(directory / file, framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    mismatch = fsdp.shape_mismatch({name: tuple(tensor.shape) for name, tensor in weights}, shapes)
    if mismatch:
        raise ValueError(f"{directory / file} does not fit the model{'s adapter' if is_adapter else ''}: {mismatch}")
    if is_adapter:
        saved, ours = json.loads((directory / ADAPTER_CONFIG).read_text()), model.peft_config[lora.ADAPTER]
        for key, value in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
            if saved.get(key) != value:
                raise ValueError(f"{directory / ADAPTER_CONFIG}: {key}={saved.get(key)!r}, "
                                 f"the model's adapter has {value!r}")
    if optimizer is not None and not state.get("has_optimizer", False):
        raise ValueError(f"{directory} was saved without optimizer state; pass optimizer=None to load only the "
                         f"{'adapter' if is_adapter else 'weights'}")


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> tuple[int, dict]:
    """Restore the weights (a LoRA model: its adapter), optimizer state and RNG states from `directory` into a
    model prepared as for training (sharded or not; apply_lora with the same settings); every rank calls it."""
    directory = Path(directory)
    fsdp.on_rank0(lambda: _verify(directory, model, optimizer))
    state = json.loads((directory / STATE).read_text())
    if optimizer is not None:
        fsdp.load_optimizer_state(str(directory / "optimizer"), model, optimizer)
    # Read only now: the weights are then not held while the optimizer state loads (through a copy).
    weights, file = _trained_weights(model)
    fsdp.load_full_weights(weights, load_file(directory / file) if fsdp.rank() == 0 else None)
    if state["world_size"] == fsdp.world_size():
        _restore_rng(directory)
    else:
        warnings.warn(f"{directory} was saved by {state['world_size']} ranks and is resumed by {fsdp.world_size()}: "
                      f"{'adapter' if state.get('lora') else 'weights'} and optimizer state are restored, random "
                      "number generator states are not")
    return int(state["step"]), state["extra"]
