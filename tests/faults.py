"""Fault injection from the test side (the library carries no test hooks): patches applied to a run in this
process, or to `launch.train` run as a script.

    python tests/faults.py --pause-in-save SECONDS -- [launch.train arguments]

--pause-in-save: every checkpoint save sleeps after its files are written and before they are marked
complete, so a test can kill the run inside a save.
"""
from __future__ import annotations

import argparse
import functools
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


def nonfinite_losses(monkeypatch, steps: set[int], calls_per_step: int) -> None:
    """Make the RL loop's loss infinite in the given 0-based steps; the loop computes `calls_per_step`
    micro-batch losses per step (one per micro-batch per PPO epoch)."""
    import grpo.trainer as trainer

    original, calls = trainer.micro_batch_loss, [0]

    def loss(*args, **kwargs):
        value, metrics = original(*args, **kwargs)
        step = calls[0] // calls_per_step
        calls[0] += 1
        return (value * float("inf") if step in steps else value), metrics

    monkeypatch.setattr(trainer, "micro_batch_loss", loss)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tests/faults.py")
    parser.add_argument("--pause-in-save", type=float, default=None)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.pause_in_save is not None:
        pause_in_save(args.pause_in_save)
    from launch.train import main as train_main
    return train_main([a for a in args.train_args if a != "--"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
