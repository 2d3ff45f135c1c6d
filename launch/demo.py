"""`make demo`: SFT then GRPO on the embedded SmolLM2-135M-Instruct, on a task the project generates itself.

    python -m launch.demo [--out runs/demo] [--train-rows 400] [--heldout-rows 16]

1. writes the generated evidence task (data.synthetic: claims about invented entities, numbered context
   sentences, SUPPORTS / REFUTES / NOT_ENOUGH_INFO, gold evidence known) as train and held-out rows;
2. SFT cold start (launch/configs/demo_sft.yaml), scoring the held-out rows before and after;
3. GRPO from the SFT checkpoint (launch/configs/demo.yaml) with the same SciFact evidence reward;
4. prints the run directories and a before/after table (format success, reward, accuracy, held out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from launch.config import load_config

CONFIGS = Path(__file__).resolve().parent / "configs"


def table(results: list[tuple[str, dict]]) -> str:
    lines = ["| held-out prompts | format success | reward | accuracy |", "|---|---|---|---|"]
    for name, r in results:
        lines.append(f"| {name} | {r['eval_format_rate']:.3f} | {r['eval_reward']:.3f} | {r['eval_acc']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="demo directory (data/, sft/, grpo/)")
    parser.add_argument("--train-rows", type=int, default=400)
    parser.add_argument("--heldout-rows", type=int, default=16)
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides applied to both stages")
    args = parser.parse_args(argv)

    from data.rows import write_rows
    from data.synthetic import generate_rows
    from launch.dist import init_distributed
    from launch.train import run

    out = Path(args.out)
    train_file, heldout_file = out / "data" / "train.jsonl", out / "data" / "heldout.jsonl"
    write_rows(generate_rows(args.train_rows, seed=0, split="train"), train_file)
    write_rows(generate_rows(args.heldout_rows, seed=1, split="heldout"), heldout_file)
    common = [f"data.train_files=['{train_file}']", f"data.eval_files=['{heldout_file}']",
              f"trainer.out_dir={out.parent}", *args.overrides]
    dist = init_distributed()
    started = time.perf_counter()

    sft_cfg = load_config(CONFIGS / "demo_sft.yaml", common + [f"trainer.run_name={out.name}/sft"])
    sft = run(sft_cfg, dist)
    if "interrupted" in sft:
        print(f"interrupted: SFT checkpoint under {sft['run_dir']}/checkpoints", file=sys.stderr)
        return 130
    rl_cfg = load_config(CONFIGS / "demo.yaml", common + [
        f"trainer.run_name={out.name}/grpo", f"init_from={out / 'sft' / 'checkpoints' / f'step_{sft_cfg.trainer.steps}'}",
        "trainer.eval_before=false"])
    rl = run(rl_cfg, dist)
    if "interrupted" in rl:
        print(f"interrupted: GRPO checkpoint under {rl['run_dir']}/checkpoints", file=sys.stderr)
        return 130
    minutes = (time.perf_counter() - started) / 60

    results = [("base model", sft["before"]), (f"after SFT ({sft_cfg.trainer.steps} steps)", sft["after"]),
               (f"after SFT + GRPO ({rl_cfg.trainer.steps} steps)", rl["after"])]
    report = table(results)
    (out / "summary.md").write_text(report + "\n")
    (out / "summary.json").write_text(json.dumps(dict(results), indent=1))
    print(f"\nRun directories: {sft['run_dir']} (SFT), {rl['run_dir']} (GRPO); training and evaluation took "
          f"{minutes:.1f} min\n\n{report}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
