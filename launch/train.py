"""The one entry point for SFT and RL (GRPO / DAPO / Dr. GRPO / process-reward GRPO), one process or torchrun.

    python -m launch.train --config launch/configs/demo.yaml [key.sub=value ...] [--resume] [--dry-run]
    python -m launch.train --config launch/configs/veriseek_grpo.yaml --dry-run --device cuda --world-size 8 \
        --gpu-memory-gib 80 --model-config tests/data/models/qwen3-4b/config.json   # + per-GPU memory
    torchrun --nproc_per_node=8 -m launch.train --config launch/configs/veriseek_grpo.yaml
    torchrun --nproc_per_node=8 --max-restarts=3 -m launch.train ... trainer.resume=auto   # a dead rank restarts
    torchrun --nnodes=2 --node_rank=$RANK --rdzv_endpoint=$HOST:29500 --nproc_per_node=8 -m launch.train ...

The run directory (trainer.out_dir/trainer.run_name) gets config.yaml, metrics.jsonl, samples.jsonl,
eval.json (held-out before/after) and checkpoints/step_<n>/ (HF format + optimizer/RNG state)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from grpo.config import Config, ConfigError, startup_warnings
from grpo.trainer import StepFailed
from launch.build import build, build_scorer
from launch.dist import CollectiveFailed, DistInfo, exit_rank, init_distributed, shutdown
from launch.memory import check_fit, read_model_config, this_gpu_gib
from launch.memory import describe as describe_memory
from launch.plan import Target, describe_batch, run_plan
from launch.preflight import prepare
from launch.recipe import load_config
from models import resolve_model_dir


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML recipe (launch/configs/*.yaml); defaults when omitted")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint (trainer.resume=always)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the recipe and data, print it and, last, the plan (launch/plan.py) as JSON; exit")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="--dry-run: plan for this device instead of this machine's (only settings are checked)")
    parser.add_argument("--world-size", type=int,
                        help="--dry-run: plan for this many torchrun ranks (default: this launch's)")
    parser.add_argument("--gpu-memory-gib", type=float,
                        help="--dry-run: check the memory estimate against GPUs of this size (default: this GPU's)")
    parser.add_argument("--model-config", help="--dry-run: the model's config.json for the memory estimate, where the "
                        "recipe's model is not a local directory")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. optim.lr=1e-6")
    return parser.parse_args(argv)


@contextmanager
def interrupt_requests(announce: bool = True):
    """Ctrl-C (SIGINT) and a scheduler's preemption (SIGTERM) ask the loop to stop at the end of the current step,
    so the checkpoint then written is one an uninterrupted run would have written. Yields the request: `received`,
    the stop signal this process received first (0 before any), `since` when, and `agreed`, the one every rank
    stops for (set by the caller: the largest over ranks, so SIGTERM wins over SIGINT).
    A second SIGINT within 2 s is the same request (under torchrun a rank gets the terminal's and torchrun's copy);
    a later one aborts at once. A repeated SIGTERM never aborts: schedulers and torchrun resend it before SIGKILL."""
    request = SimpleNamespace(received=0, since=0.0, agreed=0)
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield request
        return

    def handler(signum, frame):
        if signum == signal.SIGINT and request.received and time.monotonic() - request.since > 2.0:
            raise KeyboardInterrupt
        if not request.received:
            request.received, request.since = signum, time.monotonic()
            if announce:
                print(f"WARNING: {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                      "(Ctrl-C again to abort)", file=sys.stderr, flush=True)

    previous = {number: signal.signal(number, handler) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


class RunFailed(RuntimeError):
    """A run that failed after start-up, with the phase, the step and the rank named (the cause is chained)."""


# Where a collective failed, what it usually means (gloo's and NCCL's wording).
_COLLECTIVE_HINTS = (("timed out", "a collective waited longer than trainer.collective_timeout_s={timeout:g} s: "
                                   "another rank stopped answering"),
                     ("connection closed by peer", "another rank died"),
                     ("connection reset by peer", "another rank died"))


def describe_failure(error: BaseException, *, rank: int, step: int | None, collective_timeout_s: float) -> str:
    """'<phase> failed at step <n> on rank <r>: <error>': phase and step from a grpo.trainer.StepFailed, else
    "training step" at `step` (or "start-up"), with the collective that failed and a hint at its usual cause."""
    phase = "training step" if step is not None else "start-up"
    if isinstance(error, StepFailed):
        phase, step, error = error.phase, error.step, error.__cause__
    if isinstance(error, CollectiveFailed):
        phase, error = f"{phase} ({error})", error.__cause__
    where = f"at step {step}" if step is not None else "at start-up"
    text = f"{type(error).__name__}: {error}"
    hints = [hint.format(timeout=collective_timeout_s) for marker, hint in _COLLECTIVE_HINTS if marker in text.lower()
             and not isinstance(error, TimeoutError)]  # a reward's own timeout (launch.reward_pool) says what it is
    return f"{phase} failed {where} on rank {rank}: {text}" + (f" ({hints[0]})" if hints else "")


def run(cfg: Config, dist: DistInfo, *, rows: list[dict] | None = None, eval_rows: list[dict] | None = None) -> dict:
    """Build, score the held-out rows before, train, score after. Returns {"run_dir", "before", "after"} (the
    held-out results: count, means with 95% intervals, per-prompt values), or "interrupted" (steps done) and
    "signal" (the stop signal's number). A failure after start-up raises RunFailed naming phase, step and rank."""
    dist = dataclasses.replace(dist, tp_size=cfg.rollout.tp_size)  # which ranks share one engine replica
    with interrupt_requests(announce=dist.is_main) as request:
        def stop() -> bool:
            # Every rank must stop after the same step: the request is reduced over ranks once per step.
            request.agreed = int(dist.all_reduce_max(torch.tensor(float(request.received), device=dist.device)))
            return request.agreed > 0

        built = None
        try:
            built = build(cfg, dist, stop_requested=stop, rows=rows, eval_rows=eval_rows)
            return built.finish(built, built.loop(built.parts, dist), request.agreed)
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception as error:
            step = built.checkpoints.step if built is not None and built.checkpoints is not None else None
            raise RunFailed(describe_failure(error, rank=dist.global_rank, step=step,
                                             collective_timeout_s=cfg.trainer.collective_timeout_s)) from error
        finally:
            if built is not None:
                built.close()


def _dry_run(cfg: Config, dist: DistInfo, args: argparse.Namespace) -> None:
    """The checks of a real start before the model loads, then the config and, as stdout's last line, the plan as
    JSON. For another target (--device, --world-size) only the settings are checked: the files are the target's."""
    here = Target.here(dist.world_size, torchrun=dist.sharded)
    target = Target(args.device or here.device, args.world_size or dist.world_size,  # elsewhere: with flash-attn
                    here.flash_attn if args.device in (None, here.device) else True, torchrun=here.torchrun)
    model = cfg.init_from or cfg.model.name_or_path or "<the embedded default's directory>"
    if target == here:
        prepared = prepare(cfg, dist)
        pool = build_scorer(cfg, dist, prepared)[1]  # the rewards are called on a row each, as at a real start
        if pool is not None:
            pool.close()
        longest = max(map(len, prepared.prompt_ids + prepared.eval_prompt_ids))
        resume = f"; would resume from {prepared.latest}" if prepared.latest else ""
        warnings, summary = prepared.warnings, (
            f"ok: {len(prepared.rows)} training rows, {len(prepared.eval_rows)} held-out rows, longest prompt "
            f"{longest} tokens (data.max_prompt_tokens={cfg.data.max_prompt_tokens}){resume}")
        model = str(resolve_model_dir(prepared.source))
    else:  # run_plan below checks the settings for the target (check_plan)
        warnings, summary = startup_warnings(cfg), f"ok: settings checked for {target.device} x {target.world_size}"
    model_config = read_model_config(args.model_config or model)  # the model's config.json: memory estimate
    if args.model_config and model_config is None:
        raise ConfigError(f"--model-config: no config.json at {args.model_config}")
    gpu_gib = args.gpu_memory_gib or (this_gpu_gib() if target.device == "cuda" and torch.cuda.is_available() else None)
    plan = run_plan(cfg, target, model, model_config, gpu_gib, read_model_config(cfg.algorithm.teacher))
    if dist.is_main:
        print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        for warning in warnings:
            print(f"WARNING: {warning}", file=sys.stderr)
        if plan["memory"] is None:
            print(f"NOTE: no memory estimate: {model} has no config.json here (pass --model-config PATH)",
                  file=sys.stderr)
        else:
            print(describe_memory(plan["memory"]))
        print(summary + (f"; {describe_batch(plan['batch'])}" if plan["batch"] else ""))
    check_fit(plan["memory"])
    if dist.is_main:
        print(json.dumps(plan))


def main(argv=None) -> int:
    """Exit codes: 0 done; 1 failed (RunFailed names the phase, the step and the rank); 2 a config error, found
    before anything is written; 124 a stalled weight sync (grpo.trainer.sync_deadline); 128 + the signal when stopped
    by Ctrl-C (130) or SIGTERM (143) after finishing the step and writing a checkpoint."""
    args, dist = parse_args(argv), None
    try:
        cfg = load_config(args.config, args.overrides + (["trainer.resume=always"] if args.resume else []))
        dist = init_distributed(cfg)
        if args.dry_run:
            _dry_run(cfg, dist, args)
            return 0
        summary = run(cfg, dist)
        if summary.get("rollout_rank"):
            return 128 + summary["signal"] if summary["signal"] else 0
        if "interrupted" in summary:
            name = signal.Signals(summary["signal"]).name
            written = (f"checkpoint written under {summary['run_dir']}/checkpoints (continue with --resume or "
                       f"trainer.resume=auto)" if cfg.trainer.checkpoint == "full" else
                       f"no resumable checkpoint (trainer.checkpoint={cfg.trainer.checkpoint})")
            print(f"rank {dist.rank}: stopped by {name} after step {summary['interrupted']}; {written}",
                  file=sys.stderr)
            return 128 + summary["signal"]
        if dist.is_main:
            print(json.dumps({"run_dir": summary["run_dir"], **{moment: summary[moment].get("means", {})
                                                                  for moment in ("before", "after")}}, indent=1))
        return 0
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:
        # The one line that says what failed, where and when; the traceback goes to a file beside the run's logs.
        path = Path(cfg.trainer.out_dir) / cfg.trainer.run_name / f"traceback_rank{dist.global_rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
        print(f"RunFailed: {error} (traceback: {path})", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist is not None:
            shutdown(dist)


if __name__ == "__main__":
    exit_rank(main())
