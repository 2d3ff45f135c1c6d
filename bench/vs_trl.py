"""This trainer against TRL's GRPOTrainer on the same work, alternating A B A B, each run in its own process.

    python -m bench.vs_trl --trl-python /work/venv-trl/bin/python        # 2 prompts x G=4, 32 tokens, 2 rounds
    python -m bench.vs_trl --trl-python PY --rounds 3 --steps 3 --threads 1 --out bench/results/vs_trl.json
    python -m bench.vs_trl --trl-python PY --precision bf16 --allocator cached  # both sides bf16 over fp32 weights
    python -m bench.vs_trl --print-settings                             # the settings of both sides, then exit
    python -m bench.vs_trl --quick --trl-python PY                      # smoke run: tiny random model

TRL is installed in its own environment (`pip install trl` next to this project, e.g. the `bench` extra);
--trl-python names that interpreter (default: this one). Each round runs ours, then TRL, each a fresh
subprocess running --steps measured steps after one warm-up step; a round gives --steps per-step ratios
ours/TRL (step i of ours over step i of TRL in the same round). A step's time is end-to-end wall time:
from the end of the previous step (for the first, the start of training) to the end of this one, so it
includes generation, scoring, the update, weight sync (none in one process, on either side) and logging.
The CPU-time ratio (each process's CPU seconds over the same intervals) is printed beside it: a machine
shared with other jobs disturbs it less. Both sides run with --threads torch threads; on a busy 2-core
machine --threads 1 gave steadier and faster steps on both sides than 2 (measured: bench/README.md).

The same on both sides: the model (embedded SmolLM2-135M-Instruct, fp32, sdpa, loaded by models.load_model
from one HF directory), its tokenizer and chat template (apply_chat_template with the generation prompt),
the prompts (data.synthetic rows in file order: ours data.shuffle=false, TRL shuffle_dataset=False), the
reward (rewards.compute_score for scifact_evidence; TRL gets it wrapped in its reward_funcs signature), P
prompts x G completions per step in one generation batch and one micro-batch, sampling (temperature 1,
top_p 1, top_k 0), exactly N new tokens per completion (see below), GRPO with group-scaled advantages,
clip 0.2/0.2, token-mean ("dapo") loss, no KL and no reference model, one update per rollout (no old-logprob
pass on either side), fused AdamW (torch.optim.AdamW(fused=True), betas 0.9/0.999, no weight decay: ours
builds it in launch/build.py, TRL gets optim="adamw_torch_fused"), constant learning rate,
gradient clipping at 1.0, torch threads, seed.

Settings that differ from a side's defaults, and why:
- exactly N new tokens: ours runs its engine with an end-of-sequence id that is never sampled; TRL gets
  generation_kwargs min_new_tokens=N (end-of-sequence masked until N). Both then generate and train on
  P*G*N completion tokens per step (the JSON reports the counts each side saw), so no side wins by
  stopping early. The sampled distributions differ only in whether EOS could be drawn.
- TRL: bf16=False and gradient_checkpointing=False (its defaults are True; ours is fp32 without
  checkpointing); optim="adamw_torch_fused" stated explicitly (transformers' default for torch >= 2.8); lr_scheduler_type
  "constant" (HF's default decays linearly); beta=0, loss_type "dapo", epsilon 0.2 stated explicitly.
- ours: trainer.micro_batch_size = P*G (one backward per step, as TRL's per_device_train_batch_size = P*G).
Generation differs by design: ours is rollout.hf_engine.HFEngine (its own KV-cache loop), TRL's is
transformers' model.generate; logprob passes: ours models.logprobs.completion_logprobs, TRL's the model's
fused_lm_head forward. Those are the implementations being compared.
Peak RSS: each side's process high-water mark (VmHWM) over the whole process, and over training alone
(reset after the model and trainer are built).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import write_results


# --allocator: which side's process keeps freed memory (launch/dist.py, keep_freed_memory). "shipped": each side as it
# ships (ours does, through trainer.keep_freed_memory; TRL does not); "cached": both (TRL's process gets the
# same two glibc settings as environment variables); "system": neither (glibc's defaults on both sides).
ALLOCATORS = ("shipped", "cached", "system")


PRECISIONS = ("fp32", "bf16")


def fairness_settings(*, prompts: int, group: int, new_tokens: int, lr: float, steps: int, seed: int,
                      threads: int, allocator: str = "shipped", precision: str = "fp32") -> dict:
    """What each side is configured with: `ours` is a list of trainer config overrides (model, rows file and
    run directory are added by the child), `trl` the GRPOConfig keyword arguments (output_dir added),
    `trl_environment` what TRL's process gets beside the environment it inherits."""
    if prompts < 1 or group < 2 or new_tokens < 1 or steps < 1:
        raise ValueError(f"need prompts >= 1, group >= 2, new_tokens >= 1, steps >= 1; got {prompts}, {group}, "
                         f"{new_tokens}, {steps}")
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    bf16 = precision == "bf16"
    from launch.dist import MALLOC_ENVIRONMENT as ENVIRONMENT
    batch = prompts * group
    ours = [f"rollout.n={group}", f"rollout.max_new_tokens={new_tokens}", "rollout.temperature=1.0",
            "rollout.top_p=1.0", "rollout.top_k=0", f"trainer.prompts_per_step={prompts}",
            f"trainer.micro_batch_size={batch}", f"trainer.steps={steps}", f"optim.lr={lr}", "optim.weight_decay=0.0",
            "optim.betas=[0.9, 0.999]", "optim.schedule=constant", "optim.warmup_steps=0", "optim.grad_clip=1.0",
            "algorithm.adv_estimator=grpo", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2",
            "algorithm.agg=token-mean", "algorithm.kl_coef=0.0", "algorithm.ppo_epochs=1", "data.shuffle=false",
            "model.dtype=float32", f"model.param_dtype={'bfloat16' if bf16 else 'float32'}",
            "model.attn_implementation=sdpa", f"seed={seed}", "trainer.eval_before=false",
            f"trainer.keep_freed_memory={allocator != 'system'}"]
    trl = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=group,
               max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens},
               temperature=1.0, top_p=1.0, top_k=0, learning_rate=lr, weight_decay=0.0, adam_beta1=0.9,
               adam_beta2=0.999, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
               optim="adamw_torch_fused", scale_rewards="group", epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
               beta=0.0, num_iterations=1, mask_truncated_completions=False, shuffle_dataset=False,
               max_steps=steps, bf16=bf16, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=seed,
               logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
               dataloader_num_workers=0, log_completions=False)
    differences = [
        "exactly N new tokens: ours samples with an end-of-sequence id that is never drawn; TRL gets "
        "generation_kwargs min_new_tokens=N",
        ("bf16 on both sides over fp32 master weights: ours model.param_dtype=bfloat16 (autocast, the engine on "
         "its own bf16 copy synced after every update), TRL bf16=True (its default); TRL gradient_checkpointing="
         "False (its default is True; ours has none)") if bf16 else
        "TRL bf16=False, gradient_checkpointing=False (TRL defaults True; ours fp32, no checkpointing)",
        "TRL optim=adamw_torch_fused (the fused AdamW ours uses; transformers' default for torch >= 2.8); "
        "lr_scheduler_type=constant",
        f"ours trainer.micro_batch_size={batch} (= TRL per_device_train_batch_size: one backward per step)",
        f"torch threads {threads} on both sides",
        {"shipped": "allocator as shipped: ours keeps freed memory (trainer.keep_freed_memory), TRL glibc's default",
         "cached": "both keep freed memory (TRL's process: " + " ".join(f"{k}={v}" for k, v in ENVIRONMENT.items()) + ")",
         "system": "glibc's default allocator on both sides (ours trainer.keep_freed_memory=false)"}[allocator]]
    return {"ours": ours, "trl": trl, "differences": differences, "threads": threads, "allocator": allocator,
            "precision": precision,
            "trl_environment": dict(ENVIRONMENT) if allocator == "cached" else {},
            "shape": {"prompts": prompts, "group": group, "new_tokens": new_tokens, "steps": steps, "lr": lr}}


def _peak_bytes() -> int:
    from bench.step import status_bytes
    return status_bytes("VmHWM")


def _child_ours(settings: dict, model_dir: str, rows_file: str, out_dir: str) -> dict:
    from bench.step import reset_peak_rss, run_steps

    setup_peak = [0]

    def after_build(parts):
        setup_peak[0] = _peak_bytes()
        reset_peak_rss()

    overrides = settings["ours"] + [f"model.name_or_path={model_dir}", f"data.train_files=['{rows_file}']",
                                    "data.eval_files=[]", f"trainer.out_dir={out_dir}", "trainer.run_name=vs_trl"]
    result = run_steps(overrides, no_eos=True, on_build=after_build)
    ends = [result["started_at"]] + [step["ended_at"] for step in result["steps"]]
    cpu_ends = [result["started_cpu"]] + [step["ended_cpu"] for step in result["steps"]]
    phases = {phase: [step["phases"][phase]["seconds"] for step in result["steps"]]
              for phase in ("rollout", "reward", "update", "sync")}
    return {"step_seconds": [b - a for a, b in zip(ends, ends[1:])],
            "step_cpu_seconds": [b - a for a, b in zip(cpu_ends, cpu_ends[1:])], "phases": phases,
            "generated_tokens": [step["generated_tokens"] for step in result["steps"]],
            "trained_tokens": [step["trained_tokens"] for step in result["steps"]],
            "setup_peak_rss_bytes": setup_peak[0], "train_peak_rss_bytes": _peak_bytes()}


def _trl_reward(prompts, completions, ground_truth, data_source, **kwargs) -> list[float]:
    """rewards.compute_score in TRL's reward_funcs signature (conversational completions)."""
    import rewards
    scores = []
    for completion, truth, source in zip(completions, ground_truth, data_source):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        result = rewards.compute_score(source, text, truth)
        scores.append(float(result["score"] if isinstance(result, dict) else result))
    return scores


def _child_trl(settings: dict, model_dir: str, rows_file: str, out_dir: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.step import reset_peak_rss
    from data.rows import read_rows
    from models import load_model, load_tokenizer

    rows = read_rows(rows_file)
    dataset = Dataset.from_list([{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"],
                                  "data_source": row["data_source"]} for row in rows])
    ends, cpu_ends, step_logs, phases = [], [], [], {"generate": [], "reward": [], "prepare": []}

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                step_logs.append(dict(logs))
    config = GRPOConfig(output_dir=out_dir, **settings["trl"])
    trainer = GRPOTrainer(model=load_model(model_dir, attn_implementation="sdpa"), reward_funcs=_trl_reward,
                          args=config, train_dataset=dataset, processing_class=load_tokenizer(model_dir),
                          callbacks=[StepTimes()])
    for name, key in (("_generate_single_turn", "generate"), ("_calculate_rewards", "reward"),
                      ("_prepare_inputs", "prepare")):
        method = getattr(trainer, name)

        def timed(*args, _method=method, _key=key, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                phases[_key].append(time.perf_counter() - started)
        setattr(trainer, name, timed)
    setup_peak = _peak_bytes()
    reset_peak_rss()
    trainer.train()
    batch = settings["shape"]["prompts"] * settings["shape"]["group"]
    generated = [round(log["completions/mean_length"] * batch) for log in step_logs]
    step_seconds = [b - a for a, b in zip(ends, ends[1:])]
    update = [total - prepare for total, prepare in zip(step_seconds, phases["prepare"])]
    return {"step_seconds": step_seconds, "step_cpu_seconds": [b - a for a, b in zip(cpu_ends, cpu_ends[1:])],
            "generated_tokens": generated, "trained_tokens": generated,
            "phases": {"generate": phases["generate"], "reward": phases["reward"], "step_minus_prepare": update},
            "setup_peak_rss_bytes": setup_peak, "train_peak_rss_bytes": _peak_bytes()}


def _run_child(python: str, side: str, settings: dict, model_dir: str, rows_file: str, work: Path) -> dict:
    settings_file = work / f"settings_{side}.json"
    settings_file.write_text(json.dumps(settings))
    out_dir = tempfile.mkdtemp(prefix=f"{side}-", dir=work)
    command = [python, "-m", "bench.vs_trl", "--child", side, str(settings_file), model_dir, rows_file, out_dir]
    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   **(settings["trl_environment"] if side == "trl" else {})}
    finished = subprocess.run(command, capture_output=True, text=True, cwd=root, env=environment)
    lines = [line for line in finished.stdout.splitlines() if line.startswith("{\"step_seconds\"")]
    if finished.returncode != 0 or not lines:
        raise RuntimeError(f"the {side} side failed (exit {finished.returncode}): {' '.join(command)}\n"
                           f"{finished.stderr[-3000:]}")
    return json.loads(lines[-1])


def _ratios(runs: list[dict], key: str, warmup: int) -> dict:
    ratios = []
    for pair in runs:
        ours, theirs = pair["ours"][key][warmup:], pair["trl"][key][warmup:]
        ratios += [a / b for a, b in zip(ours, theirs)]
    if not ratios:
        raise ValueError("no measured steps to compare: raise --steps")
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios), "pairs": len(ratios),
            "all": ratios}


def compare(runs: list[dict], warmup: int = 1) -> dict:
    """Per-step ratios ours/TRL within each round (warm-up steps dropped), their min/median/max, peak RSS.

    `ratio` compares wall time (the figure the target is stated in); `cpu_ratio` the processes' CPU seconds per
    step, which a busy shared machine disturbs less (both include idle spinning of torch's worker threads)."""
    summary = {"ratio": _ratios(runs, "step_seconds", warmup)}
    if all("step_cpu_seconds" in pair[side] for pair in runs for side in ("ours", "trl")):
        summary["cpu_ratio"] = _ratios(runs, "step_cpu_seconds", warmup)
    for side in ("ours", "trl"):
        steps = [s for pair in runs for s in pair[side]["step_seconds"][warmup:]]
        cpu = [s for pair in runs for s in pair[side].get("step_cpu_seconds", [])[warmup:]]
        summary[side] = {"median_step_seconds": statistics.median(steps),
                         "median_step_cpu_seconds": statistics.median(cpu) if cpu else None,
                         "peak_rss_bytes": max(max(p[side]["setup_peak_rss_bytes"], p[side]["train_peak_rss_bytes"])
                                               for p in runs),
                         "train_peak_rss_bytes": max(p[side]["train_peak_rss_bytes"] for p in runs),
                         "generated_tokens_per_step": sorted({t for p in runs for t in p[side]["generated_tokens"]}),
                         "phase_medians": {name: statistics.median(v for p in runs for v in p[side]["phases"][name][warmup:])
                                           for name in runs[0][side]["phases"]}}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter with trl installed")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (one warm-up step is added)")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on both sides")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="shipped",
                        help="shipped: ours keeps freed memory, TRL glibc's default; cached: both keep it; "
                             "system: neither (launch/dist.py, keep_freed_memory)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32 on both sides, or bf16 compute over fp32 master weights on both (TRL's bf16=True)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 1 round, 8 tokens")
    parser.add_argument("--print-settings", action="store_true")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        side, settings_file, model_dir, rows_file, out_dir = args.child
        settings = json.loads(Path(settings_file).read_text())
        import torch
        torch.set_num_threads(settings["threads"])
        child = _child_ours if side == "ours" else _child_trl
        print(json.dumps(child(settings, model_dir, rows_file, out_dir)), flush=True)
        return 0
    if args.quick:
        args.rounds, args.steps, args.new_tokens = 1, 1, 8
    settings = fairness_settings(prompts=args.prompts, group=args.group, new_tokens=args.new_tokens, lr=args.lr,
                                 steps=args.steps + 1, seed=args.seed, threads=args.threads,
                                 allocator=args.allocator, precision=args.precision)
    if args.print_settings:
        print(json.dumps(settings, indent=1))
        return 0
    from bench.step import prepare_model
    from data.rows import write_rows
    from data.synthetic import generate_rows
    from models import resolve_model_dir

    with tempfile.TemporaryDirectory(prefix="nanogrpo-vs-trl-") as temporary:
        work = Path(temporary)
        model_dir = prepare_model("default", args.quick, work) or str(resolve_model_dir(None))
        rows_file = work / "rows.jsonl"
        write_rows(generate_rows(args.prompts * (args.steps + 1), seed=args.seed), rows_file)
        runs, load = [], [os.getloadavg()]
        for round_number in range(args.rounds):
            pair = {side: _run_child(sys.executable if side == "ours" else args.trl_python, side, settings,
                                     model_dir, str(rows_file), work) for side in ("ours", "trl")}
            runs.append(pair)
            load.append(os.getloadavg())
            print(f"round {round_number + 1}: ours {[round(s, 2) for s in pair['ours']['step_seconds']]} s, "
                  f"TRL {[round(s, 2) for s in pair['trl']['step_seconds']]} s (first step: warm-up); CPU s: ours "
                  f"{[round(s, 2) for s in pair['ours']['step_cpu_seconds']]}, TRL "
                  f"{[round(s, 2) for s in pair['trl']['step_cpu_seconds']]}", flush=True)
    summary = compare(runs)
    mib = 2**20
    ratio = summary["ratio"]
    print(f"per-step wall time ours/TRL: min {ratio['min']:.3f}, median {ratio['median']:.3f}, max {ratio['max']:.3f} "
          f"over {ratio['pairs']} step pairs (target: median <= 0.40)")
    cpu = summary["cpu_ratio"]
    print(f"per-step CPU time ours/TRL:  min {cpu['min']:.3f}, median {cpu['median']:.3f}, max {cpu['max']:.3f}")
    for side in ("ours", "trl"):
        row = summary[side]
        phases = ", ".join(f"{name} {value:.2f} s" for name, value in row["phase_medians"].items())
        print(f"{side:<4}: median step {row['median_step_seconds']:.2f} s ({row['median_step_cpu_seconds']:.2f} CPU s); peak RSS {row['peak_rss_bytes'] / mib:.0f} MiB "
              f"(training only {row['train_peak_rss_bytes'] / mib:.0f} MiB); generated tokens per step "
              f"{row['generated_tokens_per_step']}; phases: {phases}")
    print("settings that differ: " + "; ".join(settings["differences"]))
    print(f"load average (1 min) before and after each round: {[round(l[0], 2) for l in load]}")
    if args.out:
        write_results(args.out, {"settings": settings, "runs": runs, "summary": summary, "load_average": load,
                                 "trl_python": args.trl_python})
    return 0


if __name__ == "__main__":
    sys.exit(main())
