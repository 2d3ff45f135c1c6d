"""This process's place in the run: the process group (torchrun) or one process, the few collectives the loops
need, handed to them as one small frozen value (DistInfo; without torchrun the collectives are identities), the
CPU allocator setting, and the rank's exit."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import faulthandler
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from grpo.config import Config, check_placement
from launch.plan import Target, process_groups
from models import fsdp


@dataclass(frozen=True)
class DistInfo:
    """rank / world_size count the ranks of this rank's role: all when colocated; the trainers, or the engine ranks,
    under rollout.placement=separate (`role` says which; `links` holds the groups between them). The tp_size
    consecutive ranks of one vLLM replica form data-parallel group dp_rank of dp_size: they draw the same prompts
    and seeds, and rank tp_rank of the group trains on its share."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object = None  # DeviceMesh over this role's ranks (FSDP2), None for one process and for engine ranks
    all_reduce_sum: Callable = lambda tensor: tensor  # one process: the identity
    all_reduce_max: Callable = lambda tensor: tensor
    tp_size: int = 1
    global_rank: int = 0  # the rank in the torchrun world
    role: str = "colocated"  # or "trainer" / "rollout" under rollout.placement=separate
    links: Links | None = None  # the groups between the roles under rollout.placement=separate

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
        return self.mesh is not None or self.links is not None

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


@dataclass(frozen=True)
class Links:
    """rollout.placement=separate: ranks [0, T) train, [T, W) run the engines. `link` (gloo, all ranks: batches and
    held-out results) and `weights` (trainer 0 and the engine ranks: the weight broadcast)."""
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    link: object
    weights: object


class CollectiveFailed(RuntimeError):
    """One of the loops' collectives failed (the message names it; the cause is chained), e.g. when
    trainer.collective_timeout_s passed: launch.train names it beside the phase and the step."""


def all_reduce(op, group=None) -> Callable:
    """The all-reduce `op` over `group` (None: the world) of a copy of a tensor."""
    def reduce(tensor):
        tensor = tensor.clone()
        try:
            torch_dist.all_reduce(tensor, op=op, group=group)
        except Exception as error:
            raise CollectiveFailed(f"all_reduce {op.name.lower()}") from error
        return tensor
    return reduce


def init_distributed(cfg: Config | None = None) -> DistInfo:
    """One process, or the torchrun world of any size (even one rank gets a process group and FSDP2, so
    `torchrun --nproc_per_node=1` runs the multi-GPU path). Call once, before building vLLM. A collective raises
    after trainer.collective_timeout_s (a dead rank is an error, not a hang); rollout.placement=separate cuts the
    world into trainer and engine ranks."""
    cfg = cfg or Config()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    separate = cfg.stage == "rl" and cfg.rollout.placement == "separate"
    if separate:
        check_placement(cfg, world_size)  # before the world is cut into roles
    if world_size == 1 and not under_torchrun():
        return DistInfo(device=device)
    timeout = datetime.timedelta(seconds=cfg.trainer.collective_timeout_s)
    if not torch_dist.is_initialized():
        backend, options = "gloo", {}  # gloo's collectives raise in the caller when they time out
        if cuda:
            # device_id creates the communicator at once, on this rank's GPU. NCCL's collectives are asynchronous:
            # a timed-out one is found by its watchdog thread, which aborts the process naming the collective and
            # the rank; faulthandler then prints every thread's stack (the phase). Blocking wait (opt-in) raises
            # our named error in the calling thread instead. A user's setting is kept.
            backend, options = "nccl", {"device_id": device}
            faulthandler.enable(all_threads=True)
            if cfg.trainer.nccl_blocking_wait:
                os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's store outlives a restart (--max-restarts) with the dead attempt's keys still in it, and
            # gloo would dial the dead ranks' old addresses: every attempt gets keys of its own.
            store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                        is_master=False, timeout=timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            options |= dict(store=torch_dist.PrefixStore(f"nanogrpo/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world_size)
        torch_dist.init_process_group(backend, timeout=timeout, **options)
    rank = torch_dist.get_rank()
    if not separate:
        return DistInfo(rank=rank, world_size=world_size, device=device,
                        mesh=init_device_mesh(device.type, (world_size,)), global_rank=rank,
                        all_reduce_sum=all_reduce(torch_dist.ReduceOp.SUM),
                        all_reduce_max=all_reduce(torch_dist.ReduceOp.MAX))
    # Every rank creates every group, in the same order; each role gets its ranks, collectives and (trainers) mesh.
    specs = process_groups(cfg, Target(device.type, world_size, torchrun=True))
    groups = {name: torch_dist.new_group(spec["ranks"], backend=spec["backend"], timeout=timeout)
              for name, spec in specs.items() if name != "world"}
    trainers, engines = tuple(specs["trainers"]["ranks"]), tuple(specs["engines"]["ranks"])
    training = rank in trainers
    ranks, group = (trainers, groups["trainers"]) if training else (engines, groups["engines"])
    fsdp.use_group(group)
    return DistInfo(rank=rank - ranks[0], world_size=len(ranks), device=device,
                    mesh=DeviceMesh.from_group(group, device.type) if training else None,  # the trainers shard
                    all_reduce_sum=all_reduce(torch_dist.ReduceOp.SUM, group),
                    all_reduce_max=all_reduce(torch_dist.ReduceOp.MAX, group), global_rank=rank,
                    role="trainer" if training else "rollout",
                    links=Links(trainers, engines, groups["link"], groups["weights"]))


def under_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def shutdown(dist: DistInfo) -> None:
    # vLLM may have torn the group down already ("Invalid process group specified"): guard the teardown.
    if dist.distributed and torch_dist.is_initialized():
        with contextlib.suppress(Exception):
            torch_dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End the process with `code`, after shutdown(). One process exits as usual; a torchrun rank flushes its streams
    and logging and leaves with os._exit: DTensor's caches keep the DeviceMesh and the gloo group's threads alive
    past destroy_process_group, and the interpreter's teardown then sometimes aborts (SIGABRT; bench/README.md)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not under_torchrun():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or gone (a broken pipe): nothing can reach it
            stream.flush()
    os._exit(code)


# --- CPU runs: glibc keeps freed memory in the process (trainer.keep_freed_memory) ------------------------------

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (glibc's malloc.h)
# The same settings as environment variables, for a process that cannot call keep_freed_memory (bench.vs_trl's TRL).
MALLOC_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def keep_freed_memory() -> bool:
    """Turn off mmap for large blocks (M_MMAP_MAX=0) and heap trimming (M_TRIM_THRESHOLD=-1), process-wide: glibc
    serves every large block with a fresh mmap and unmaps it on free, so a step page-faults its activations,
    gradients and logit chunks in again every step (bench/README.md, "Freed memory kept in the process"). Returns
    whether the setting is in effect (False where the C library has no mallopt, e.g. macOS or musl)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))
