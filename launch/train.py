"""The one entry point for SFT and RL (GRPO / DAPO / Dr. GRPO / process-reward GRPO), one process or torchrun.

    python -m launch.train --config launch/configs/demo_grpo.yaml [key.sub=value ...] [--resume] [--dry-run]
    torchrun --nproc_per_node=8 -m launch.train --config launch/configs/veriseek_grpo.yaml
    torchrun --nnodes=2 --node_rank=$RANK --rdzv_endpoint=$HOST:29500 --nproc_per_node=8 -m launch.train ...

The run directory (trainer.out_dir/trainer.run_name) gets config.yaml, metrics.jsonl, samples.jsonl,
eval.json (held-out before/after) and checkpoints/step_<n>/ (HF format + optimizer/RNG state).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager

import yaml

from launch.config import ConfigError, load_config, to_dict


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe (launch/configs/*.yaml); defaults when omitted")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="check the recipe and data, print it, and exit")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. optim.lr=1e-6")
    return parser.parse_args(argv)


@contextmanager
def interrupt_requests(log):
    """Ctrl-C (SIGINT) asks the loop to stop at the end of the current step; yields `requested() -> bool`.

    The step is finished rather than cut, so the checkpoint then written is one an uninterrupted run would
    have written. A second SIGINT within 2 s counts as the same request (under torchrun each rank gets the
    terminal's and then torchrun's copy, and torchrun sends SIGKILL 30 s later); a later one aborts at once,
    leaving the last periodic checkpoint.
    """
    first: list[float] = []
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield lambda: False
        return

    def handler(signum, frame):
        if first and time.monotonic() - first[0] > 2.0:
            raise KeyboardInterrupt
        if not first:
            first.append(time.monotonic())
            log.warn("interrupt: finishing this step, then writing a checkpoint (Ctrl-C again to abort)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(first)
    finally:
        signal.signal(signal.SIGINT, previous)


def run(cfg, dist, *, resume: bool = False) -> dict:
    """Build the parts, evaluate held-out rows before, train, evaluate after. Returns a summary."""
    import torch

    from grpo.evaluate import evaluate
    from grpo.sft import train_sft
    from grpo.trainer import train_rl
    from launch.build import build

    parts = build(cfg, dist, resume=resume)
    max_new = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens

    def held_out() -> dict:
        if not parts.eval_rows:
            return {}
        result = evaluate(parts.engine, parts.eval_rows, parts.eval_prompt_ids, parts.compute_score, dist,
                          max_new_tokens=max_new, correct_threshold=cfg.reward.correct_threshold)
        result.pop("records")
        return result

    summary = {"run_dir": str(parts.run_dir), "before": held_out() if cfg.trainer.eval_before else {}}
    loop = train_sft if cfg.stage == "sft" else train_rl
    try:
        with interrupt_requests(parts.log) as requested:
            # Every rank must stop after the same step: the request is reduced over ranks once per step.
            parts.stop_requested = lambda: bool(dist.all_reduce_max(
                torch.tensor(float(requested()), device=dist.device)) > 0)
            summary["final"] = loop(cfg, dist, parts)
    finally:
        parts.log.close()
    if parts.completed_steps < cfg.trainer.steps:
        summary["interrupted"] = parts.completed_steps
        return summary
    summary["after"] = held_out()
    if dist.is_main:
        (parts.run_dir / "eval.json").write_text(json.dumps({k: summary[k] for k in ("before", "after")}, indent=1))
    if parts.engine is not None and hasattr(parts.engine, "close"):
        parts.engine.close()
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    from launch.dist import init_distributed, shutdown
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    dist = init_distributed()
    try:
        if args.dry_run:
            from launch.build import check_config
            rows, eval_rows = check_config(cfg, dist)
            if dist.is_main:
                print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
                print(f"ok: {len(rows)} training rows, {len(eval_rows)} held-out rows")
            return 0
        summary = run(cfg, dist, resume=args.resume)
        if "interrupted" in summary:
            print(f"interrupted after step {summary['interrupted']}; checkpoint written under "
                  f"{summary['run_dir']}/checkpoints (continue with --resume)", file=sys.stderr)
            return 130
        if dist.is_main:
            print(json.dumps({k: summary[k] for k in ("run_dir", "before", "after")}, indent=1))
        return 0
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    finally:
        shutdown(dist)


if __name__ == "__main__":
    sys.exit(main())
