"""`make demo`: what RL adds, on the embedded SmolLM2-135M-Instruct and a task the project generates itself.

    python -m launch.demo [--out runs/demo] [--heldout-rows 64] [--heldout-seed 1] [key.sub=value ...]

On the generated evidence task (data.synthetic), three arms run in turn: GRPO from the base model (it stalls: every
group is flat), SFT, then GRPO from the SFT checkpoint; docs/demo.md says what each shows and what it measured.
summary.md gives each held-out mean its 95% interval and each arm its paired difference to its start."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from data.rows import write_rows
from data.arithmetic import generate_rows as arithmetic_rows
from data.synthetic import generate_rows
from grpo.evaluate import summarize
from grpo.stats import paired_difference
from launch.recipe import load_config
from launch.dist import init_distributed
from launch.plot import read_metrics, training_curves
from launch.train import run

CONFIGS = Path(__file__).resolve().parent / "configs"
METRICS = (("reward", "reward"), ("format", "format"), ("acc", "label accuracy"), ("evidence", "evidence"))


def _difference(before: dict, after: dict, metric: str) -> str:
    pairs = [(a, b) for a, b in zip(before["values"][metric], after["values"][metric])
             if a is not None and b is not None]
    mean, low, high = paired_difference([a for a, _ in pairs], [b for _, b in pairs])
    return f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def table(rows: list[tuple[str, dict, str | None, dict | None]]) -> str:
    """rows: (name, held-out result, the name of the row it started from, that row's result or None)."""
    metrics = [(key, label) for key, label in METRICS if all(key in result["means"] for _, result, _, _ in rows)]
    count = rows[0][1]["count"]
    lines = [f"Held-out prompts: {count}, greedy. Mean [95% interval]; change = paired difference against the "
             f"row it started from, same prompts [95% interval].", "",
             "| model | " + " | ".join(label for _, label in metrics) + " | change in reward | change in accuracy |",
             "|---|" + "---|" * (len(metrics) + 2)]
    for name, result, start, start_result in rows:
        cells = ["{mean:.3f} [{low:.3f}, {high:.3f}]".format(**result["means"][key]) for key, _ in metrics]
        changes = ["-", "-"] if start_result is None else [
            f"{_difference(start_result, result, key)} vs {start}" for key in ("reward", "acc")]
        lines.append(f"| {name} | " + " | ".join(cells + changes) + " |")
    return "\n".join(lines)


def curves(arms: list[tuple[str, Path, int, dict, dict]], path: Path) -> None:
    """One figure of held-out reward and accuracy (95% bands) and training reward over steps. arms: (name, run
    directory, step offset on the shared axis, held-out results at the arm's start and end, added if not logged)."""
    runs = {}
    for name, run_dir, offset, start, end in arms:
        records = read_metrics(run_dir / "metrics.jsonl")
        evaluated = {record["step"] for record in records if "eval/reward" in record}
        if 0 not in evaluated:  # the arm started from the previous arm's end (or from the base model)
            records.insert(0, {"step": 0, **summarize(start)})
        last = max((record["step"] for record in records), default=0)
        if last not in evaluated:
            records.append({"step": last, **summarize(end)})
        runs[name] = [{**record, "step": record["step"] + offset} for record in records]
    training_curves(runs, path, curves=(("eval/reward", "held-out reward (greedy)"),
                                        ("eval/acc", "held-out label accuracy (greedy)"),
                                        ("reward_mean", "training reward (sampled)"), ("loss", "SFT loss")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="demo directory (data/, base_grpo/, sft/, grpo/)")
    parser.add_argument("--train-rows", type=int, default=800)
    parser.add_argument("--heldout-rows", type=int, default=64)
    parser.add_argument("--heldout-seed", type=int, default=1, help="generator seed of the held-out rows (not 0)")
    parser.add_argument("--task", choices=("evidence", "tools"), default="evidence", help="tools: the arithmetic "
                        "task with a calculator (data.arithmetic): SFT on tool trajectories, then GRPO (no base arm)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to every arm")
    args = parser.parse_args(argv)
    if args.heldout_seed == 0:
        parser.error("--heldout-seed 0 is the training rows' seed: held-out rows need a seed of their own")
    out = Path(args.out)
    train_file, heldout_file = out / "data" / "train.jsonl", out / "data" / "heldout.jsonl"
    generate = arithmetic_rows if args.task == "tools" else generate_rows
    write_rows(generate(args.train_rows, seed=0, split="train"), train_file)
    write_rows(generate(args.heldout_rows, seed=args.heldout_seed, split="heldout"), heldout_file)
    common = [f"data.train_files=['{train_file}']", f"data.eval_files=['{heldout_file}']",
              f"trainer.out_dir={out.parent}"]
    dist = init_distributed()
    started, results, minutes = time.perf_counter(), {}, {}

    def arm(name: str, recipe: str, *extra: str) -> tuple:
        cfg = load_config(CONFIGS / recipe, common + [f"trainer.run_name={out.name}/{name}", *extra,
                                                      *args.overrides])
        arm_started = time.perf_counter()
        summary = run(cfg, dist)
        minutes[name] = (time.perf_counter() - arm_started) / 60
        if "interrupted" in summary:
            print(f"interrupted: {name} checkpoint under {summary['run_dir']}/checkpoints", file=sys.stderr)
            raise SystemExit(128 + summary["signal"])  # 130 after Ctrl-C, 143 after SIGTERM
        results[name] = summary
        return cfg, summary

    if args.task == "tools":  # the base model never calls the tool: no GRPO-from-base arm
        sft_cfg, sft = arm("sft", "tools_sft.yaml")
        checkpoint = out / "sft" / "checkpoints" / f"step_{sft_cfg.trainer.steps}"
        rl_cfg, rl = arm("grpo", "tools_grpo.yaml", f"init_from={checkpoint}")
        report = table([("base model", sft["before"], None, None),
                        (f"SFT ({sft_cfg.trainer.steps} steps)", sft["after"], "base", sft["before"]),
                        (f"SFT + GRPO ({rl_cfg.trainer.steps} steps)", rl["after"], "SFT", sft["after"])])
        (out / "summary.md").write_text(report + "\n")
        print(f"\n{report}\n")
        return 0
    sft_cfg, sft = arm("sft", "demo_sft.yaml")  # scores the base model before its first step
    base_cfg, base_grpo = arm("base_grpo", "demo_base.yaml", "trainer.eval_before=false")
    sft_checkpoint = out / "sft" / "checkpoints" / f"step_{sft_cfg.trainer.steps}"
    rl_cfg, rl = arm("grpo", "demo.yaml", f"init_from={sft_checkpoint}", "trainer.eval_before=false")
    total = (time.perf_counter() - started) / 60

    base = sft["before"]
    rows = [("base model", base, None, None),
            (f"GRPO from base ({base_cfg.trainer.steps} steps)", base_grpo["after"], "base", base),
            (f"SFT ({sft_cfg.trainer.steps} steps)", sft["after"], "base", base),
            (f"SFT + GRPO ({rl_cfg.trainer.steps} steps)", rl["after"], "SFT", sft["after"])]
    flat = [record["flat_group_frac"] for record in read_metrics(Path(base_grpo["run_dir"]) / "metrics.jsonl")
            if "flat_group_frac" in record]
    report = table(rows) + (f"\n\nGRPO from the base model: flat-group fraction {sum(flat) / len(flat):.2f} over "
                            f"its {len(flat)} steps (1.00: every group's rewards equal, no gradient).")
    curves([("GRPO from base", Path(base_grpo["run_dir"]), 0, base, base_grpo["after"]),
            ("SFT", Path(sft["run_dir"]), 0, base, sft["after"]),
            ("SFT then GRPO", Path(rl["run_dir"]), sft_cfg.trainer.steps, sft["after"], rl["after"])],
           out / "curves.png")
    (out / "summary.md").write_text(report + "\n")
    (out / "summary.json").write_text(json.dumps({name: {k: s[k] for k in ("run_dir", "before", "after")}
                                                  for name, s in results.items()}, indent=1))
    each = ", ".join(f"{name} {arm_minutes:.1f}" for name, arm_minutes in minutes.items())
    runs = ", ".join(summary["run_dir"] for summary in results.values())
    print(f"\nTraining and evaluation took {total:.1f} min ({each}). Runs: {runs}\n\n{report}\n\n"
          f"Curves: {out / 'curves.png'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
