"""The memory estimate (launch/memory.py) against a measurement: one RL step of the embedded SmolLM2-135M on CPU.

    python -m bench.memory_check                 # 2 prompts x G=4, 48 new tokens (no early EOS), two steps
    python -m bench.memory_check --new-tokens 128 --out bench/results/memory_check.json

The steps are the real trainer's (bench.step.run_steps: launch.build + grpo.trainer.train_rl), two of them, one
prompt's group per micro-batch. Measured: the second step's update phase, its peak resident memory (VmHWM in
/proc/self/status, reset by writing 5 to /proc/self/clear_refs at its first forward with gradients) minus the
resident size at that moment: gradients, saved activations, the logits chunks and every transient, with AdamW's
state already resident (as before every step after the first) and the first micro-batch's gradients resident while
the second one's activations are saved. Estimated: the plan's training-phase figure for the same config, evaluated at
the largest micro-batch's token count (a forward pre-hook counts them), less what is resident before the step
(weights, optimizer state; CPU has no CUDA-context term). glibc's freed-memory cache is off
(trainer.keep_freed_memory=false, and the process re-runs itself with MALLOC_MMAP_THRESHOLD_=65536 as
bench/sync.py's children do) so freed tensors leave the resident set at once and it follows live memory. The
whole-process figure (peak minus the resident size before the model loaded, against the whole training-phase
estimate) is printed too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.step import run_steps, status_bytes, trainer_overrides

GIB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2, help="P: prompts per step")
    parser.add_argument("--group", type=int, default=4, help="G: completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=48, help="rollout.max_new_tokens (every completion)")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("overrides", nargs="*", help="extra trainer config overrides, key.sub=value")
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # glibc reads it at start-up only
        command = [sys.executable, "-m", "bench.memory_check", *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, command, {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

    import torch

    from data.rows import write_rows
    from data.synthetic import generate_rows
    from launch.memory import read_model_config
    from launch.plan import Target, run_plan
    from launch.recipe import load_config
    from models import resolve_model_dir

    before_model = status_bytes("VmRSS")
    tokens: list[int] = []  # tokens of every forward with gradients (the updates')

    def count_tokens(module, positional, keywords):
        ids = keywords.get("input_ids", positional[0] if positional else None)
        if torch.is_grad_enabled() and ids is not None:
            tokens.append(ids.numel())

    def on_build(parts):
        parts.policy.model.register_forward_pre_hook(count_tokens, with_kwargs=True)

    with tempfile.TemporaryDirectory(prefix="nanogrpo-memory-check-") as work:
        rows_file = Path(work) / "rows.jsonl"
        write_rows(generate_rows(8, seed=0), rows_file)
        overrides = trainer_overrides(None, rows_file, Path(work) / "runs", prompts=args.prompts, group=args.group,
                                      new_tokens=args.new_tokens, steps=2, lr=1e-6, seed=0)
        # One prompt's group per micro-batch: the first micro-batch's gradients are resident while the next one's
        # activations are saved, as in any run with more than one micro-batch.
        overrides += ["trainer.keep_freed_memory=false", f"trainer.micro_batch_size={args.group}", *args.overrides]
        result = run_steps(overrides, no_eos=True, on_build=on_build)
        cfg = load_config(None, overrides)
    if not result["peak_reset"]:
        print("the peak mark could not be reset (/proc/self/clear_refs): no measurement", file=sys.stderr)
        return 1
    # The second step: AdamW's state exists before it, as before every step after the first.
    update = result["steps"][1]["phases"]["update"]
    # The largest micro-batch's tokens: the step's forwards with gradients, split evenly over its micro-batches
    # (the shared-prompt pass runs a prompt forward and a completion forward for each).
    micro_batches = args.prompts * args.group // cfg.trainer.micro_batch_size
    step_forwards = tokens[len(tokens) // 2:]
    per = len(step_forwards) // micro_batches
    largest = max(sum(step_forwards[i:i + per]) for i in range(0, len(step_forwards), per))
    trainer = dataclasses.replace(cfg.trainer, max_tokens_per_micro_batch=largest)
    measured_cfg = dataclasses.replace(cfg, trainer=trainer)
    memory = run_plan(measured_cfg, Target("cpu", 1), model_config=read_model_config(resolve_model_dir(None)))["memory"]
    training = memory["roles"]["trainer"]["training"]
    resident = training["weights"] + training["optimizer"] + training.get("reference", 0)  # before the step
    report = {"tokens_per_micro_batch": largest, "micro_batches": micro_batches,
              "forwards_per_step": len(step_forwards),
              "estimate_training_gib": training,
              "step": {"measured_gib": update["extra_rss_bytes"] / GIB, "estimated_gib": training["total"] - resident},
              "process": {"measured_gib": (update["peak_rss_bytes"] - before_model) / GIB,
                          "estimated_gib": training["total"]}}
    for key in ("step", "process"):
        report[key]["ratio"] = report[key]["measured_gib"] / report[key]["estimated_gib"]
    print(f"update: {micro_batches} micro-batches of at most {largest} tokens ({len(step_forwards)} forwards)")
    print("estimate (training phase, GiB): " + ", ".join(f"{name} {value:.3f}" for name, value in training.items()))
    print(f"allocated by the second step's update: measured {report['step']['measured_gib']:.3f} GiB, estimated "
          f"{report['step']['estimated_gib']:.3f} GiB (training total less weights and optimizer state): ratio "
          f"{report['step']['ratio']:.2f}")
    print(f"whole process: measured {report['process']['measured_gib']:.3f} GiB over the resident size before the "
          f"model loaded, estimated {training['total']:.3f} GiB: ratio {report['process']['ratio']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
