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
import math
import signal
import sys
import threading
import time
from contextlib import contextmanager

import yaml

from grpo.config import Config
from launch.config import ConfigError, load_config, to_dict


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe (launch/configs/*.yaml); defaults when omitted")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="check the recipe and data, print it, and exit")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. optim.lr=1e-6")
    return parser.parse_args(argv)


@contextmanager
def interrupt_requests(announce: bool = True):
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
            if announce:
                print("WARNING: interrupt: finishing this step, then writing a checkpoint (Ctrl-C again to abort)",
                      file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(first)
    finally:
        signal.signal(signal.SIGINT, previous)


def _jsonable(result: dict) -> dict:
    """A held-out result for eval.json: count, means with intervals, per-prompt values (NaN as null)."""
    clean = lambda x: None if isinstance(x, float) and math.isnan(x) else x  # noqa: E731
    return {"count": result["count"], "means": {k: [clean(x) for x in v] for k, v in result["means"].items()},
            "values": {k: [clean(x) for x in v] for k, v in result["values"].items()}}


def run(cfg: Config, dist, *, resume: bool = False) -> dict:
    """Build, score the held-out rows before, train, score after. Returns {"run_dir", "before", "after"} (the
    held-out results: count, means with 95% intervals, per-prompt values), or "interrupted" (steps done)."""
    import torch

    from grpo.sft import train_sft
    from grpo.trainer import train_rl
    from launch.build import build

    with interrupt_requests(announce=dist.is_main) as requested:
        # Every rank must stop after the same step: the request is reduced over ranks once per step.
        stop = lambda: bool(dist.all_reduce_max(torch.tensor(float(requested()), device=dist.device)) > 0)  # noqa: E731
        built = build(cfg, dist, resume=resume, stop_requested=stop)
        held_out, start = built.held_out, built.checkpoints.start_step
        summary = {"run_dir": str(built.run_dir), "before": {}}
        if held_out is not None and cfg.trainer.eval_before:
            summary["before"] = _jsonable(held_out.result(start))
        loop = train_sft if cfg.stage == "sft" else train_rl
        try:
            summary["final"] = loop(cfg, dist, built.parts)
        finally:
            built.log.close()
    if built.checkpoints.completed_steps < cfg.trainer.steps:
        summary["interrupted"] = built.checkpoints.completed_steps
        return summary
    summary["after"] = _jsonable(held_out.result(cfg.trainer.steps)) if held_out is not None else {}
    if dist.is_main:
        (built.run_dir / "eval.json").write_text(json.dumps({k: summary[k] for k in ("before", "after")}, indent=1))
    if built.engine is not None and hasattr(built.engine, "close"):
        built.engine.close()
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
