"""Process-group set-up and the few collectives the loops need, handed to them as a small frozen value.

Without torchrun everything runs as one process: the collectives are identities.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as torch_dist


def _identity(tensor):
    return tensor


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object = None  # DeviceMesh over all ranks (FSDP2), None for one process
    all_reduce_sum: Callable = _identity
    all_reduce_max: Callable = _identity
    tp_size: int = 1  # ranks per engine replica (launch.plan.tp_groups): consecutive ranks share prompts and seeds
    placement: Placement | None = None  # rollout.placement=separate: this rank's role and the groups between roles

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Under torchrun (a process group and its mesh, even of one rank): the policy is sharded with FSDP2."""
        return self.mesh is not None

    @property
    def distributed(self) -> bool:
        """A process group exists (torchrun): the teardown has one to destroy."""
        return self.mesh is not None or self.placement is not None

    @property
    def dp_rank(self) -> int:
        """The replica (data-parallel group of the rollout) this rank belongs to."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        """This rank's place in its replica: which share of the replica's groups it trains on."""
        return self.rank % self.tp_size


class CollectiveFailed(RuntimeError):
    """One of the loops' collectives failed (the cause is chained), e.g. when trainer.collective_timeout_s passed:
    launch.train names it beside the phase and the step."""

    def __init__(self, collective: str):
        super().__init__(collective)
        self.collective = collective


def _all_reduce(op, group=None):
    def reduce(tensor):
        tensor = tensor.clone()
        try:
            torch_dist.all_reduce(tensor, op=op, group=group)
        except Exception as error:
            raise CollectiveFailed(f"all_reduce {op.name.lower()}") from error
        return tensor
    return reduce


@dataclass(frozen=True)
class Placement:
    """rollout.placement=separate: ranks [0, T) train, ranks [T, W) run the engines (launch/separate.py).

    trainer_ranks / rollout_ranks: global ranks of each role. Groups (every rank creates every one, in the same
    order): `link` (gloo, all ranks: batches and held-out results, point to point) and `weights` (trainer 0 and
    the rollout ranks, NCCL on GPUs: the weight broadcast)."""
    role: str  # "trainer" or "rollout"
    global_rank: int
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    link: object
    weights: object

    @property
    def is_rollout(self) -> bool:
        return self.role == "rollout"


def process_group_options(device: torch.device, *, blocking_wait: bool = True) -> tuple[str, dict, dict]:
    """(backend, extra init_process_group keyword arguments, environment variables to set first) for `device`.

    NCCL (CUDA): device_id binds the group to this rank's GPU (the communicator is created at once, on the right
    device, instead of lazily at the first collective). Its collectives are asynchronous: by default a timed-out
    one is found by NCCL's watchdog thread, which tears the process down with its own message and our named
    error (phase, step, rank) never appears. TORCH_NCCL_BLOCKING_WAIT=1 makes the calling thread wait for each
    collective and raise there when trainer.collective_timeout_s passes, so launch.train names it as it does on
    gloo (trainer.nccl_blocking_wait=false turns it off). A variable the user set is left as it is.
    gloo (CPU): collectives already raise in the caller.

    >>> process_group_options(torch.device("cuda", 3))
    ('nccl', {'device_id': device(type='cuda', index=3)}, {'TORCH_NCCL_BLOCKING_WAIT': '1'})
    >>> process_group_options(torch.device("cpu"))
    ('gloo', {}, {})
    """
    if device.type != "cuda":
        return "gloo", {}, {}
    return "nccl", {"device_id": device}, ({"TORCH_NCCL_BLOCKING_WAIT": "1"} if blocking_wait else {})


def init_distributed(timeout_s: float = 1800.0, *, nccl_blocking_wait: bool = True, rollout_ranks: int = 0) -> DistInfo:
    """One process, or the torchrun world (nccl on CUDA, gloo on CPU: process_group_options), of any size: under
    torchrun even one rank gets its process group and FSDP2 (`torchrun --nproc_per_node=1` runs the multi-GPU
    code path on one GPU). Call once, before building vLLM.

    timeout_s (trainer.collective_timeout_s): how long a collective waits for the other ranks before it raises,
    so a rank that died or stopped answering ends the run with an error instead of a hang. rollout_ranks > 0
    (rollout.placement=separate): the last rollout_ranks ranks run the engines; this rank's DistInfo then counts
    the ranks of its own role only (its collectives, mesh and models.fsdp's group are its role's), and
    `placement` holds the groups between the roles."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size == 1 and not under_torchrun():
        return DistInfo(device=device)
    if not torch_dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        backend, options, environment = process_group_options(device, blocking_wait=nccl_blocking_wait)
        for name, value in environment.items():
            os.environ.setdefault(name, value)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's store outlives a restart (--max-restarts) with the dead attempt's keys still in it, and
            # gloo would dial the dead ranks' old addresses: every attempt gets keys of its own.
            store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                        is_master=False, timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            torch_dist.init_process_group(backend, store=torch_dist.PrefixStore(f"nanogrpo/attempt_{attempt}", store),
                                          rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout,
                                          **options)
        else:
            torch_dist.init_process_group(backend, timeout=timeout, **options)
    if rollout_ranks:
        return _separate(torch_dist.get_rank(), world_size, rollout_ranks, local_rank, device)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world_size,))
    return DistInfo(rank=torch_dist.get_rank(), world_size=world_size, local_rank=local_rank, device=device,
                    mesh=mesh, all_reduce_sum=_all_reduce(torch_dist.ReduceOp.SUM),
                    all_reduce_max=_all_reduce(torch_dist.ReduceOp.MAX))


def _separate(rank: int, world_size: int, rollout_ranks: int, local_rank: int, device: torch.device) -> DistInfo:
    """The DistInfo of one role of a separate placement (see init_distributed)."""
    from torch.distributed.device_mesh import DeviceMesh

    from models import fsdp
    if not 0 < rollout_ranks < world_size:
        raise ValueError(f"rollout.num_ranks={rollout_ranks} must leave at least one of the {world_size} ranks "
                         f"training and take at least one")
    trainers = tuple(range(world_size - rollout_ranks))
    engines = tuple(range(len(trainers), world_size))
    trainer_group = torch_dist.new_group(list(trainers))
    rollout_group = torch_dist.new_group(list(engines), backend="gloo")
    link = torch_dist.new_group(list(range(world_size)), backend="gloo")
    weights = torch_dist.new_group([trainers[0], *engines])
    training = rank in trainers
    ranks, group = (trainers, trainer_group) if training else (engines, rollout_group)
    placement = Placement("trainer" if training else "rollout", rank, trainers, engines, link, weights)
    fsdp.use_group(group)
    return DistInfo(rank=rank - ranks[0], world_size=len(ranks), local_rank=local_rank, device=device,
                    mesh=DeviceMesh.from_group(group, device.type) if training else None,  # the trainers shard
                    all_reduce_sum=_all_reduce(torch_dist.ReduceOp.SUM, group),
                    all_reduce_max=_all_reduce(torch_dist.ReduceOp.MAX, group), placement=placement)


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def barrier(dist: DistInfo) -> None:
    if dist.distributed:
        torch_dist.barrier()


def shutdown(dist: DistInfo) -> None:
    # vLLM may have torn the group down already ("Invalid process group specified"): guard the teardown.
    if dist.distributed and torch_dist.is_initialized():
        try:
            torch_dist.destroy_process_group()
        except Exception:
            pass


def exit_rank(code: int) -> NoReturn:
    """End the process with `code`; a torchrun rank (WORLD_SIZE > 1) skips the interpreter's teardown.

    Call it last, after shutdown(). DTensor's caches (its sharding propagator's, its redistribute planner's) keep
    the DeviceMesh, so the gloo process group and its threads, alive past destroy_process_group, and a finished
    rank now and then aborted in the interpreter's teardown that followed ("terminate called without an active
    exception", SIGABRT, no Python frame; how often is in bench/README.md). A rank has closed its files and its
    reward workers by then, so it flushes the standard streams and the logging handlers and leaves with os._exit.
    One process (no torchrun) exits as usual."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not under_torchrun():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone (a broken pipe): nothing more can reach it
            pass
    os._exit(code)
