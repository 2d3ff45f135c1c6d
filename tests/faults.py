"""Fault injection from the test side (the library carries no test hooks): patches applied to a run in this
process, or to `launch.train` run as a script.

    python tests/faults.py [--pause-in-save SECONDS] [--stall-sync-at CALL] [--file-size-limit-after-saves N BYTES]
                           -- [launch.train arguments]

--pause-in-save: every checkpoint save sleeps after its files are written and before they are marked
complete, so a test can kill the run inside a save.
--stall-sync-at: the CALL-th weight sync (1: the one at start-up, k + 1: the one of step k) never returns, as a
sync stuck in an engine or a transfer does.
--file-size-limit-after-saves: after N complete checkpoints, no file may grow beyond BYTES (RLIMIT_FSIZE, with
SIGXFSZ ignored so the write fails with EFBIG instead of killing the process), as on a disk that fills up.
"""
from __future__ import annotations

import argparse
import functools
import resource
import signal
import sys
import time


def pause_in_save(seconds: float) -> None:
    """Make models.checkpoint.save_checkpoint sleep once its files (weights, optimizer, RNG) are written."""
    import models.checkpoint as checkpoint

    original = checkpoint._write_rng

    @functools.wraps(original)
    def write_then_sleep(*args, **kwargs):
        original(*args, **kwargs)
        time.sleep(seconds)

    checkpoint._write_rng = write_then_sleep


def stall_sync_at(call: int) -> None:
    """Make the run's weight sync into its engine (grpo.groups.LocalRollout.sync_weights) hang forever on its
    call-th call."""
    from grpo.groups import LocalRollout

    original, calls = LocalRollout.sync_weights, [0]

    def stalling_sync(self):
        calls[0] += 1
        if calls[0] == call:
            while True:
                time.sleep(60)
        return original(self)

    LocalRollout.sync_weights = stalling_sync


def file_size_limit_after_saves(saves: int, limit_bytes: int) -> None:
    """After `saves` complete checkpoints, limit every file this process writes to `limit_bytes`."""
    import models.checkpoint as checkpoint

    original, done = checkpoint.save_checkpoint, [0]

    @functools.wraps(original)
    def save_then_limit(*args, **kwargs):
        path = original(*args, **kwargs)
        done[0] += 1
        if done[0] == saves:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return path

    checkpoint.save_checkpoint = save_then_limit


def nonfinite_losses(monkeypatch, steps: set[int], calls_per_step: int) -> None:
    """Make the RL loop's loss infinite in the given 0-based steps; the loop computes `calls_per_step`
    micro-batch losses per step (one per micro-batch per PPO epoch)."""
    import grpo.update as update

    original, calls = update.rl_loss, [0]

    def loss(*args, **kwargs):
        value, metrics = original(*args, **kwargs)
        step = calls[0] // calls_per_step
        calls[0] += 1
        return (value * float("inf") if step in steps else value), metrics

    monkeypatch.setattr(update, "rl_loss", loss)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tests/faults.py")
    parser.add_argument("--pause-in-save", type=float, default=None)
    parser.add_argument("--stall-sync-at", type=int, default=None)
    parser.add_argument("--file-size-limit-after-saves", type=int, nargs=2, default=None)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.pause_in_save is not None:
        pause_in_save(args.pause_in_save)
    if args.stall_sync_at is not None:
        stall_sync_at(args.stall_sync_at)
    if args.file_size_limit_after_saves is not None:
        file_size_limit_after_saves(*args.file_size_limit_after_saves)
    from launch.train import main as train_main
    return train_main([a for a in args.train_args if a != "--"])


if __name__ == "__main__":
    from launch.dist import exit_rank
    exit_rank(main(sys.argv[1:]))
