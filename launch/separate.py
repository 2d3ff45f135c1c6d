"""Rollout on ranks of its own (rollout.placement=separate; docs/conventions.md, "Rollout on its own ranks"): the
batches and weights travel over process groups of their own (launch.dist.Links).

Both sides run the same sequence (j: a step; v_j: the weights after j optimizer steps; S: max_staleness):

    start    trainer 0 broadcasts the start (first step, each replica's data position) and v_start
    rollout  for j in start .. steps - 1:
                 S = 1: generate b_j with the weights it has (v_{j-1}; v_start at j = start)
                 j > start: join the broadcast of v_j (or of a stop: leave)
                 S = 0: generate b_j with v_j
                 score the held-out rows when the loop evaluates after j (grpo.trainer.held_out_due)
                 the replica's first rank sends each trainer it serves msg_j: its share of b_j, the version of the
                 weights that generated it, the replica's data position after it, the held-out result
             join the broadcast of v_steps; with held-out rows score them and send msg_steps (no batch)
             join the stop broadcast; leave
    trainer  msg_j -> prepare, update -> broadcast v_{j+1} -> (held-out after j + 1: msg_{j+1}'s) -> ...
             at the end (or at a stop request): drain a message still on its way, broadcast the stop"""
from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from grpo.config import Config
from grpo.groups import Batch, LocalRollout
from grpo.trainer import held_out_due
from launch.dist import DistInfo
from models.lora import merged_state_dict
from rollout.engine import stream_seed
from rollout.sync import bucketed, tensor_bytes, updating_weights


@dataclass
class Message:
    """What a trainer receives for step j from its replica."""
    step: int
    batch: Batch | None  # its share, None after the last step
    position: int  # the replica's data position after generating it
    held_out: dict | None  # grpo.evaluate.evaluate's result with the weights v_j, when the loop evaluates after j


@dataclass
class Header:
    """What trainer 0 broadcasts before the weights: a stop (then no weights follow) or the next version."""
    stop: bool
    start: int = 0  # the first step (the start broadcast)
    positions: tuple[int, ...] = ()  # each replica's data position at the start
    signal: int = 0  # the stop signal the trainers agreed on (0: the run ended)


def send_object(value, destination: int, group) -> None:
    """Pickle `value` and send it to global rank `destination` over `group` (its size first, then its bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    torch_dist.send(torch.tensor([payload.numel()], dtype=torch.long), dst=destination, group=group)
    torch_dist.send(payload, dst=destination, group=group)


def receive_object(source: int, group, timeout_s: float):
    """What send_object sent from global rank `source`. Waits at most timeout_s (trainer.collective_timeout_s) for
    each part: a point-to-point receive on gloo otherwise waits forever for an engine rank that stopped answering."""
    size = torch.empty(1, dtype=torch.long)
    _wait(torch_dist.irecv(size, src=source, group=group), source, timeout_s)
    payload = torch.empty(int(size), dtype=torch.uint8)
    _wait(torch_dist.irecv(payload, src=source, group=group), source, timeout_s)
    return pickle.loads(payload.numpy().tobytes())


def _wait(work, source: int, timeout_s: float) -> None:
    if not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
        raise RuntimeError(f"Timed out after {timeout_s:g} s waiting for a message from rank {source}")


def receive_weights(engine, group, device: torch.device) -> Header:
    """A rollout rank: trainer 0's header and, unless a stop, each bucket, loaded into the engine as it arrives."""
    holder = [None]
    torch_dist.broadcast_object_list(holder, src=0, group=group)
    header = holder[0]
    if header.stop:
        return header
    with updating_weights(engine):
        while True:
            torch_dist.broadcast_object_list(holder, src=0, group=group)
            manifest = holder[0]
            if manifest is None:
                break
            tensors = {}
            for dtype in sorted({entry[2] for entry in manifest}, key=str):
                entries = [entry for entry in manifest if entry[2] == dtype]
                sizes = [torch.Size(shape).numel() for _, shape, _ in entries]
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
                torch_dist.broadcast(flat, src=0, group=group)
                for (name, shape, _), part in zip(entries, flat.split(sizes)):
                    tensors[name] = part.view(shape)
            engine.update_weights([(name, tensors[name]) for name, _, _ in manifest])
    return header


class RemoteRollout:
    """A trainer rank's rollout (grpo.groups.Rollout) when the engines run apart: its share of a step's scored
    groups from replica rank // (T / R), and the weights broadcast back. `position` is that replica's data position
    after the last batch this rank trained (what a checkpoint records)."""

    def __init__(self, cfg: Config, dist: DistInfo, model: torch.nn.Module, *, has_held_out: bool):
        links = dist.links
        self.cfg, self.links, self.model, self.has_held_out = cfg, links, model, has_held_out
        self.timeout_s, self.bucket_bytes = cfg.trainer.collective_timeout_s, cfg.rollout.sync_bucket_mb << 20
        self.source = links.rollout_ranks[dist.global_rank // (len(links.trainer_ranks) // cfg.rollout.num_ranks)]
        self.messages: dict[int, Message] = {}
        self.received = -1  # the last step whose message arrived
        self.position = self.version = 0
        self.sender = dist.global_rank == links.trainer_ranks[0]  # trainer 0 broadcasts the weights

    def _message(self, step: int) -> Message:
        while step not in self.messages:
            message = receive_object(self.source, self.links.link, self.timeout_s)
            self.messages[message.step] = message
            self.received = message.step
        return self.messages[step]

    def _broadcast(self, header: Header) -> dict:
        """Every trainer rank gathers the policy's full tensors (FSDP2) in the engines' dtype (model.param_dtype);
        trainer 0 broadcasts the header, then each bucket (a manifest of names, shapes and dtypes, then one flat
        tensor per dtype): what receive_weights loads."""
        group, sender = self.links.weights, self.sender
        started, total, count = time.perf_counter(), 0, 0
        if sender:
            torch_dist.broadcast_object_list([header], src=0, group=group)
        if header.stop:
            return {}
        for bucket in bucketed(merged_state_dict(self.model, getattr(torch, self.cfg.model.param_dtype)),
                                self.bucket_bytes):
            count += 1
            total += sum(tensor_bytes(tensor) for _, tensor in bucket)
            if sender:
                manifest = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in bucket]
                torch_dist.broadcast_object_list([manifest], src=0, group=group)
                for dtype in sorted({entry[2] for entry in manifest}, key=str):
                    flat = torch.cat([tensor.reshape(-1) for _, tensor in bucket if tensor.dtype == dtype])
                    torch_dist.broadcast(flat.contiguous(), src=0, group=group)
            del bucket
        if sender:
            torch_dist.broadcast_object_list([None], src=0, group=group)  # the end of this version's buckets
        return {"sync/seconds": time.perf_counter() - started, "sync/bytes": float(total), "sync/buckets": float(count)}

    def start(self, start_step: int, positions: list[int]) -> dict:
        """Send the start (first step, each replica's data position: a trainer's checkpointed one) and v_start."""
        self.version, self.received = start_step, start_step - 1
        return self._broadcast(Header(stop=False, start=start_step, positions=tuple(positions)))

    def collect(self, step: int) -> Batch:
        message = self._message(step)
        self.position = message.position
        del self.messages[step]
        return message.batch

    def evaluate(self, step: int) -> dict | None:
        if not self.has_held_out:
            return None
        message = self._message(step)
        if message.batch is None:
            del self.messages[step]
        return message.held_out

    def sync_weights(self) -> dict:
        """Broadcast the weights after this step (v_{j+1})."""
        self.version += 1
        return self._broadcast(Header(stop=False))

    def close(self, stop_signal: int = 0) -> None:
        """Drain msg_version (on its way after the last broadcast unless it arrived already or none is sent: after
        the last step without held-out rows; its batch is never trained), then broadcast the stop."""
        following = self.version
        if following > self.received and (following < self.cfg.trainer.steps or self.has_held_out):
            self._message(following)
        self.messages.clear()
        self._broadcast(Header(stop=True, signal=stop_signal))


def serve(local: LocalRollout, dist: DistInfo) -> int:
    """An engine rank's whole run (the module docstring's sequence); returns the trainers' stop signal (0: ended)."""
    cfg, links = local.cfg, dist.links
    trainers = len(links.trainer_ranks) // len(links.rollout_ranks)
    served = range(dist.rank * trainers, (dist.rank + 1) * trainers)  # the trainer ranks this replica serves
    header = receive_weights(local.engine, links.weights, dist.device)  # the start and v_start
    start, steps = header.start, cfg.trainer.steps
    local.sampler.position = header.positions[dist.rank]

    def generate(step: int) -> list[Batch]:
        return local.collect_shares(stream_seed(cfg.seed, step, dist.rank), len(served))

    for step in range(start, steps + 1):
        if step < steps and cfg.algorithm.max_staleness == 1:  # with the weights it has: v_{j-1} (v_start at start)
            version, batches = max(step - 1, start), generate(step)
        if step > start:
            header = receive_weights(local.engine, links.weights, dist.device)
            if header.stop:
                return header.signal
        if step < steps and cfg.algorithm.max_staleness == 0:
            version, batches = step, generate(step)
        held_out = local.evaluate(step) if held_out_due(step, start, cfg.trainer) else None
        if step == steps and not local.eval_rows:
            break
        for index, trainer in enumerate(served):
            batch = batches[index] if step < steps else None
            if batch is not None:
                batch.policy_version = version
            send_object(Message(step, batch, local.sampler.position, held_out), trainer, links.link)
    return receive_weights(local.engine, links.weights, dist.device).signal
