"""FSDP2 for HF causal LMs, and every collective the models package needs. Without torch.distributed initialised
every function here also works on a plain single-process model, so callers need no branches."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_map
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from models.loading import load_model, resolve_attn_implementation, resolve_model_dir

# The ranks this package's collectives span: the whole world, or, when the rollout runs on ranks of its own
# (rollout.placement=separate), the ranks of this rank's role (launch.dist sets it once, with use_group).
_GROUP = None


def use_group(group) -> None:
    """Make every collective of models/ (ranks, barriers, broadcasts, sharded checkpoints) span `group`."""
    global _GROUP
    _GROUP = group


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This rank's place in the group (its global rank when the group is the world or its first ranks)."""
    return dist.get_rank(_GROUP) if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size(_GROUP) if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier(group=_GROUP)


def broadcast_object(value, source: int = 0):
    """`value` from the group's rank `source` on every rank of the group (itself when not distributed)."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, group_src=source, group=_GROUP)
    return holder[0]


def on_rank0(function: Callable[[], object]):
    """function() run by rank 0 alone, its result on every rank; what it raises is raised on every rank (the others
    get a ValueError or FileNotFoundError with its message), so no rank waits forever in a collective."""
    result = error = None
    if rank() == 0:
        try:
            result = function()
        except Exception as caught:
            error = caught
    result, message = broadcast_object((result, None if error is None else (type(error).__name__, str(error))))
    if message is not None:
        kind = {"FileNotFoundError": FileNotFoundError}.get(message[0], ValueError)
        raise error if error is not None else kind(message[1])
    return result


def first_error(error: BaseException | None) -> tuple[int, str] | None:
    """Every rank calls it with its own error (or None): (rank, message) of the lowest rank that failed, on every
    rank, or None when none did. A collective, so a rank that failed alone does not leave the others waiting."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    if not is_distributed():
        return None if message is None else (0, message)
    messages = [None] * world_size()
    dist.all_gather_object(messages, message, group=_GROUP)
    return next(((index, text) for index, text in enumerate(messages) if text is not None), None)


def shard(model: torch.nn.Module, mesh, *, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 over the 1-D `mesh` and return it: each decoder layer, then the root.
    param_dtype: the dtype of gathered parameters in forward/backward (None: the parameters' own dtype).

    The root (embeddings, final norm, lm_head) is never resharded after forward: its gathered lm_head weight is
    what models.logprobs projects the hidden states with between forward and backward. Gradients are reduced in
    fp32 and summed over ranks, not averaged (the losses divide by the global token count; gloo sums too).
    """
    # The decoder layers: the repeated blocks, whose class names HF lists in `_no_split_modules`.
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} "
                         f"(its _no_split_modules is {sorted(names)})")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in [*layers, model]:  # the layers first: each unit owns the parameters no inner unit took
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=module is not model)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Put every FSDP unit's shards back as its parameters (nothing for a plain model). After a forward without
    backward (a no-grad logprob pass) the root still holds its gathered parameters, in param_dtype."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def named_weights(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """(HF name, parameter or persistent buffer), tied aliases once, in the model's fixed module order: the state
    dict's entries (not the non-persistent buffers, such as rotary inv_freq, which HF rebuilds from the config)."""
    reshard(model)
    non_persistent = {f"{module_name}.{buffer_name}" if module_name else buffer_name
                      for module_name, module in model.named_modules()
                      for buffer_name in getattr(module, "_non_persistent_buffers_set", ())}
    return [*model.named_parameters(), *((name, buffer) for name, buffer in model.named_buffers()
                                         if name not in non_persistent)]


def full_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Stream (HF name, full tensor, detached) for every parameter and persistent buffer, in the same order on every
    rank, which must each consume the whole iterator (gathering a shard is a collective). Floating tensors come in
    `dtype` (None: as stored): each shard is cast before its gather, the same values as casting the full tensor in
    half the bytes for bf16 from fp32. A tied lm_head.weight is not repeated (HF's save_pretrained and vLLM's
    load_weights both accept that)."""
    for name, tensor in named_weights(model):
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shape_mismatch(expected: dict[str, tuple], given: dict[str, tuple]) -> str | None:
    """What differs between the model's {name: shape} and a file's ("missing [..], unexpected [..], wrong
    shapes [..]", five names of each at most), or None when they agree."""
    missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    wrong = [f"{name} {given[name]} (model {expected[name]})" for name in expected
             if name in given and given[name] != expected[name]]
    if missing or unexpected or wrong:
        return f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}"
    return None


@torch.no_grad()
def copy_from_rank0(target: Tensor, source: Tensor | None) -> None:
    """Copy rank 0's full tensor `source` (None on the other ranks) into `target`, a parameter or buffer: a
    DTensor's shards, a replicated tensor (by a broadcast), or a plain one in one process."""
    if source is None:  # ranks > 0: receives rank 0's values (a DTensor's shape is the full one)
        source = torch.empty(target.shape, dtype=target.dtype, device=target.device)
    source = source.to(target.device, target.dtype)
    if isinstance(target, DTensor):
        source = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=0).to_local()
        target = target.to_local()
    elif is_distributed():
        dist.broadcast(source, group_src=0, group=_GROUP)
    target.copy_(source)


def load_full_weights(weights: list[tuple[str, Tensor]], state_dict: dict[str, Tensor] | None) -> None:
    """Copy full tensors (held by rank 0; others pass None) into `weights` ((name, parameter or buffer), e.g.
    named_weights or a subset of them), every name and shape compared first, so nothing half-loads."""
    mismatch = on_rank0(lambda: shape_mismatch({name: tuple(tensor.shape) for name, tensor in weights},
                                               {name: tuple(tensor.shape) for name, tensor in state_dict.items()}))
    if mismatch:
        raise ValueError(f"weights do not match the model: {mismatch}")
    for name, target in weights:
        copy_from_rank0(target, state_dict[name] if rank() == 0 else None)


def load_sharded_model(name_or_path=None, mesh=None, *, param_dtype: torch.dtype | None = torch.bfloat16,
                       device: str | torch.device = "cpu", attn_implementation: str = "auto",
                       gradient_checkpointing: bool = False, trust_remote_code: bool = False,
                       dtype: torch.dtype = torch.float32, prepare: Callable[[torch.nn.Module], object] | None = None
                       ) -> torch.nn.Module:
    """Rank 0 reads the pretrained weights (in `dtype`, the master weights'); every rank builds the model on
    `meta`, shards it, allocates only its shards on `device` and receives them from rank 0. Ranks > 0 peak at
    one shard set; rank 0 holds the full model once more while it loads.

    prepare: called on every rank's meta model before sharding (after gradient checkpointing is enabled) and on
    rank 0's pretrained copy, e.g. models.lora.apply_lora: both then name the same parameters, and every rank
    receives rank 0's values (the adapters' seeded initialisation included)."""
    directory = str(on_rank0(lambda: resolve_model_dir(name_or_path)))
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, local_files_only=True)
    config._attn_implementation = resolve_attn_implementation(attn_implementation, device, param_dtype or dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if prepare is not None:
        prepare(model)
    shard(model, mesh, param_dtype=param_dtype)
    model.to_empty(device=device)
    full = None
    if rank() == 0:
        pretrained = load_model(directory, dtype=dtype, device="cpu", trust_remote_code=trust_remote_code)
        if prepare is not None:
            prepare(pretrained)
        # Every buffer: to_empty left those no state dict holds (rotary inv_freq) uninitialised too.
        full = dict([*pretrained.named_parameters(), *pretrained.named_buffers()])
        del pretrained
    load_full_weights([*model.named_parameters(), *model.named_buffers()], full)
    del full
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    return model


def _dcp(function, state: dict, path: str) -> None:
    """dcp.save or dcp.load of `state` at `path` over this package's group (or this process alone)."""
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes a single process, which is exactly the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        function(state, checkpoint_id=path, no_dist=not is_distributed(), process_group=_GROUP)


def save_optimizer_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """torch.distributed.checkpoint files of the optimizer state (each rank writes its shards), keyed by
    parameter name, so a resume can even change how the model is wrapped."""
    _dcp(dcp.save, {"optimizer": get_optimizer_state_dict(model, optimizer)}, path)


def load_optimizer_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore what save_optimizer_state wrote. The files are read into a copy of the state first, so a
    missing or mismatched entry raises before the optimizer's own state tensors are replaced."""
    # get_optimizer_state_dict allocates a fresh optimizer's state (a zero-lr step): a target of the right shapes.
    target = tree_map(lambda value: value.clone() if isinstance(value, Tensor) else value,
                      {"optimizer": get_optimizer_state_dict(model, optimizer)})
    try:
        _dcp(dcp.load, target, path)
    except Exception as error:
        raise ValueError(f"optimizer state in {path} does not match this model/optimizer or is damaged: "
                         f"{error}") from error
    set_optimizer_state_dict(model, optimizer, target["optimizer"])
