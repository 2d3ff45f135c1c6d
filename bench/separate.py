"""Colocated against rollout on ranks of its own, on the same cores: one process with 2 torch threads, against 2
torchrun ranks of 1 thread each (1 trainer, 1 rollout rank) synchronous (algorithm.max_staleness=0) and one step
off-policy (max_staleness=1), alternating the three in fresh processes for --rounds rounds.

    python -m bench.separate                        # embedded SmolLM2-135M, 4 prompts x G=4, 48 tokens, 4 steps
    python -m bench.separate --quick                # smoke run: tiny random model, 1 round, 2 steps of 8 tokens
    python -m bench.separate --out bench/results/separate.json --rounds 2 --steps 5

A step's time is the trainer's own (the sum of its phases: waiting for the batch, logprob passes, update, weight
broadcast), so overlapped generation shows up as a shorter wait. Reported per arm: the median step (steps after
the first) and the phases, steps per minute, and the ratio to the colocated arm measured in the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import write_results

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "colocated": ([], 1),
    "separate S=0": (["rollout.placement=separate", "rollout.num_ranks=1"], 2),
    "separate S=1": (["rollout.placement=separate", "rollout.num_ranks=1", "algorithm.max_staleness=1",
                      "algorithm.tis_cap=2.0"], 2),
}
PHASES = ("time_rollout_reward", "time_logprob", "time_update", "time_sync")


def run_arm(name: str, overrides: list[str], work: Path, threads_total: int) -> list[dict]:
    """One fresh run of an arm; its steps' phase seconds."""
    extra, ranks = ARMS[name]
    run_name = name.replace(" ", "_").replace("=", "")
    out = work / run_name
    launcher = [sys.executable, "-m", "launch.train"] if ranks == 1 else [
        str(Path(sys.executable).with_name("torchrun")), f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={29600 + os.getpid() % 300}", "-m", "launch.train"]
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads_total // ranks), "TOKENIZERS_PARALLELISM": "false",
                   "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = launcher + overrides + extra + [f"trainer.out_dir={work}", f"trainer.run_name={run_name}",
                                              f"rollout.num_threads={threads_total // ranks}"]
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    subprocess.run(["rm", "-rf", str(out)], check=False)
    return [{key: step.get(key, 0.0) for key in (*PHASES, "staleness", "reward_mean")} for step in steps]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is dropped)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (each rank gets its share)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from bench.step import prepare_model, trainer_overrides
    from data.rows import write_rows
    from data.synthetic import generate_rows
    if args.quick:
        args.rounds, args.steps, args.new_tokens = 1, 2, 8
    with tempfile.TemporaryDirectory(prefix="nanogrpo-separate-") as temporary:
        work = Path(temporary)
        model = prepare_model("default", args.quick, work)
        rows_file = work / "rows.jsonl"
        write_rows(generate_rows(args.prompts * (args.steps + 1) * 2, seed=0), rows_file)
        overrides = trainer_overrides(model, rows_file, work, prompts=args.prompts, group=args.group,
                                      new_tokens=args.new_tokens, steps=args.steps, lr=1e-6, seed=0)
        overrides += ["trainer.save_every=0"]
        rounds = []
        for round_number in range(args.rounds):
            rounds.append({name: run_arm(name, overrides, work, args.threads) for name in ARMS})
            print(f"round {round_number + 1}: " + "; ".join(
                f"{name} {[round(sum(step[p] for p in PHASES), 2) for step in steps]} s"
                for name, steps in rounds[-1].items()), flush=True)
    summary = {}
    for name in ARMS:
        measured = [step for result in rounds for step in result[name][1:]]
        median = statistics.median(sum(step[p] for p in PHASES) for step in measured)
        summary[name] = {"median_step_seconds": median, "steps_per_minute": 60 / median,
                         "phases": {p: statistics.median(step[p] for step in measured) for p in PHASES},
                         "staleness": sorted({step["staleness"] for step in measured})}
        ratios = [sum(a[p] for p in PHASES) / sum(b[p] for p in PHASES) for result in rounds
                  for a, b in zip(result[name][1:], result["colocated"][1:])]
        summary[name]["ratio_to_colocated"] = statistics.median(ratios)
        phases = ", ".join(f"{p.removeprefix('time_')} {v:.2f} s" for p, v in summary[name]["phases"].items())
        print(f"{name:<13} median step {median:.2f} s ({60 / median:.2f} steps/min), x{summary[name]['ratio_to_colocated']:.3f}"
              f" of colocated; staleness {summary[name]['staleness']}; phases: {phases}")
    if args.out:
        write_results(args.out, {"arguments": vars(args), "rounds": rounds, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
