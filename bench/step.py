"""GRPO steps broken down into rollout, reward, logprob (old/ref), update and weight sync: seconds, tokens/s
and peak memory of each phase, by running the real trainer (launch.build + grpo.trainer.train_rl).

    python -m bench.step                                  # embedded SmolLM2-135M, 2 prompts x G=4, 32 tokens, 3 steps
    python -m bench.step --sync copy                      # the engine owns a copy: weight sync is timed too
    python -m bench.step --out bench/results/step.json algorithm.kl_coef=0.01   # any config override
    python -m bench.step --quick                          # smoke run: tiny random model, 2 steps of 8 tokens
    python -m bench.step --lengths uneven --new-tokens 256  # padded vs packed update, completions of 8..256 tokens

It also prints the model FLOPs of each phase (prefill, decode, logprob passes, update; bench/flops.py has the
formula and its derivation), the machine's peak measured in the same run (a 2048^3 fp32 matmul at the same
thread count, before and after the steps) and the MFU of each phase and of the whole step.

Nothing in the step is re-implemented: the loop is train_rl itself, on the parts build() returns. The phases
are observed from outside: the engine's generate is wrapped, a forward pre-hook on the policy (and reference)
model marks the first logprob or training forward, and sync_weights and the logger are wrapped. Seconds come
from the trainer's own per-step timers (time_logprob, time_update, time_sync); its time_rollout_reward is
split into generate time (rollout) and the rest (reward: scoring). Checkpoint writing is switched off (it is
not part of a step). Step time is the sum of the five phases (the trainer's tokens_per_s uses the same sum).

Memory: "peak RSS" of a phase is the process's resident-set high-water mark (VmHWM in /proc/self/status)
between the phase's first and last moment, the mark being reset at every phase boundary (writing 5 to
/proc/self/clear_refs); "extra" is that peak minus the RSS when the phase began. It counts every byte the
process touched (weights, optimizer state, allocator caches), not only tensors; memory freed by an
earlier phase but kept by the allocator is reused without showing up as extra. Where the reset is not
permitted the numbers are the process-wide peak so far, and the JSON says so (peak_reset: false). The
reward phase's memory window runs from the end of generation to the first forward, so it also covers the
advantage arithmetic and batch padding.
On CUDA the per-phase torch.cuda.max_memory_allocated is reported as well.

`--lengths uneven`: DAPO's batches mix short and long completions, which is where padding costs most. The engine
generates --new-tokens for every row (no EOS) and each completion is then cut to a length drawn uniformly from
--min-len..--new-tokens (the same lengths in every run: the draws are seeded); the trainer runs once with its
padded update (model.packed_logprobs=false) and once packed (=true), alternating for --rounds rounds, each a
fresh build, and the update's seconds are compared step by step (steps after the first).
"""
from __future__ import annotations

import dataclasses
import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.flops import DecoderShape, measure_peak_flops, step_flops
from bench.report import write_results

PHASES = ("rollout", "reward", "logprob", "update", "sync")


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1)) * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS; False where that is not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


class PhaseMemory:
    """Peak resident memory per (step, phase): `enter(phase)` closes the open phase and starts the next."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.step = 0
        self.open: tuple[int, str, int] | None = None  # (step, phase, RSS at its start)
        self.records: dict[tuple[int, str], dict] = {}
        self.peak_reset = True

    def close(self) -> None:
        if self.open is None:
            return
        step, phase, start_rss = self.open
        peak = status_bytes("VmHWM")
        record = self.records.setdefault((step, phase), {"peak_rss_bytes": 0, "extra_rss_bytes": 0})
        record["peak_rss_bytes"] = max(record["peak_rss_bytes"], peak)
        record["extra_rss_bytes"] = max(record["extra_rss_bytes"], peak - start_rss)
        if self.cuda:
            import torch
            record["cuda_peak_allocated_bytes"] = max(record.get("cuda_peak_allocated_bytes", 0),
                                                      torch.cuda.max_memory_allocated())
        self.open = None

    def enter(self, phase: str) -> None:
        self.close()
        self.peak_reset &= reset_peak_rss()
        if self.cuda:
            import torch
            torch.cuda.reset_peak_memory_stats()
        self.open = (self.step, phase, status_bytes("VmRSS"))


def _instrument(parts, memory: PhaseMemory, generated: list[dict]) -> tuple:
    """Wrap the rollout's engine and sync and the logger; hook the models. Returns (the parts, the hooks)."""
    import torch

    engine, sync, log_metrics = parts.rollout.engine, parts.rollout.sync_weights, parts.log.metrics
    in_generate = [False]
    original_generate = engine.generate
    prefill_seconds = [0.0]

    def generate(prompts, **kwargs):
        memory.enter("rollout")
        in_generate[0] = True
        prefill_seconds[0] = 0.0
        started = time.perf_counter()
        try:
            completions = original_generate(prompts, **kwargs)
        finally:
            in_generate[0] = False
        while len(generated) <= memory.step:
            generated.append({})
        record = generated[memory.step]
        record["rollout_seconds"] = record.get("rollout_seconds", 0.0) + time.perf_counter() - started
        record["prefill_seconds"] = record.get("prefill_seconds", 0.0) + prefill_seconds[0]
        record["completions"] = record.get("completions", 0) + len(completions)
        record["generated_tokens"] = record.get("generated_tokens", 0) + sum(len(c.completion_ids) for c in completions)
        record["prompt_tokens"] = record.get("prompt_tokens", 0) + sum(len(c.prompt_ids) for c in completions)
        record.setdefault("calls", []).append({"prompts": [list(p) for p in prompts], "group": kwargs.get("n", 1),
                                               "completion_lengths": [len(c.completion_ids) for c in completions]})
        memory.enter("reward")
        return completions

    # HFEngine: the prefill of its forward path (the model's own); the rest of generate is decoding. The class
    # stays patched until the returned hooks are removed.
    from rollout.hf_engine import TransformersDecoding

    def timed_prefill(decoding):
        original = decoding.prefill

        def prefill(self, *args):
            started = time.perf_counter()
            logits = original(self, *args)
            prefill_seconds[0] += time.perf_counter() - started
            return logits

        decoding.prefill = prefill
        return SimpleNamespace(remove=lambda: setattr(decoding, "prefill", original))

    patches = [timed_prefill(TransformersDecoding)]

    def forward_pre_hook(module, args):
        if in_generate[0]:
            return
        phase = "update" if torch.is_grad_enabled() else "logprob"
        if memory.open is None or memory.open[1] != phase:
            memory.enter(phase)

    def sync_weights():
        memory.enter("sync")
        info = sync()
        memory.enter("log")
        return info

    def metrics(step, values, *args, **kwargs):
        memory.close()
        log_metrics(step, values, *args, **kwargs)
        generated[memory.step]["metrics"] = dict(values)
        generated[memory.step]["ended_at"] = time.perf_counter()
        generated[memory.step]["ended_cpu"] = time.process_time()
        memory.step += 1

    engine.generate = generate
    parts.log.metrics = metrics
    parts.rollout.sync_weights = sync_weights
    models = [parts.policy.model]
    if parts.reference is not None and parts.reference is not parts.policy.model:
        models.append(parts.reference)
    hooks = [model.register_forward_pre_hook(forward_pre_hook) for model in models]
    return parts, hooks + patches


def _step_report(record: dict, memory: PhaseMemory, step: int, ppo_epochs: int) -> dict:
    """One step's phases: seconds, tokens/s and memory, from the trainer's metrics and the wrappers."""
    metrics = record["metrics"]
    rollout = record["rollout_seconds"]
    seconds = {"rollout": rollout, "reward": max(metrics["time_rollout_reward"] - rollout, 0.0),
               "logprob": metrics["time_logprob"], "update": metrics["time_update"], "sync": metrics["time_sync"]}
    generated_tokens, trained_tokens = record["generated_tokens"], metrics["trained_tokens"]
    forward_tokens = ppo_epochs * (record["generated_tokens"] + record["prompt_tokens"])
    rates = {"rollout": ("generated tokens/s", generated_tokens), "reward": ("completions/s", record["completions"]),
             "logprob": ("completion tokens/s", generated_tokens), "update": ("trained tokens/s", trained_tokens),
             "sync": ("MB/s", metrics.get("sync/bytes", 0.0) / 1e6)}
    phases = {}
    for phase in PHASES:
        unit, amount = rates[phase]
        ran = (step, phase) in memory.records
        measurable = ran and seconds[phase] > 0 and amount > 0
        phases[phase] = {"seconds": seconds[phase], "rate": amount / seconds[phase] if measurable else None,
                         "rate_unit": unit, "ran": ran, **memory.records.get((step, phase), {})}
    phases["update"]["forward_tokens_per_s"] = forward_tokens / seconds["update"] if seconds["update"] > 0 else None
    total = sum(seconds.values())
    return {"phases": phases, "step_seconds": total, "generated_tokens": generated_tokens,
            "prefill_seconds": record.get("prefill_seconds"), "calls": record["calls"],
            "trained_tokens": trained_tokens, "tokens_per_s": metrics["tokens_per_s"],
            "reward_mean": metrics["reward_mean"],
            **{key: record[key] for key in ("prompt_tokens", "completions", "ended_at", "ended_cpu")}}


def prepare_model(model: str | None, quick: bool, work_dir: Path) -> str | None:
    """The model to load: None (embedded default), a path, or (quick) a tiny random Llama saved with the
    embedded tokenizer."""
    if not quick:
        return None if model in (None, "default") else model
    from bench.tiny import tiny_model
    from models import load_tokenizer
    directory = work_dir / "tiny"
    tiny_model("llama", seed=0).save_pretrained(directory)
    load_tokenizer(None).save_pretrained(directory)
    return str(directory)


def trainer_overrides(model: str | None, rows_file: Path, out_dir: Path, *, prompts: int, group: int,
                      new_tokens: int, steps: int, lr: float, seed: int) -> list[str]:
    """The config the benchmark trains with (extra key=value overrides are appended by the caller)."""
    return [f"model.name_or_path={model if model is not None else 'null'}", f"data.train_files=['{rows_file}']",
            "data.eval_files=[]", f"rollout.n={group}", f"rollout.max_new_tokens={new_tokens}",
            "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0", f"trainer.prompts_per_step={prompts}",
            f"trainer.micro_batch_size={prompts * group}", f"trainer.steps={steps}", f"optim.lr={lr}",
            f"seed={seed}", f"trainer.out_dir={out_dir}", "trainer.run_name=bench", "trainer.eval_before=false"]


def cut_completions(engine, min_len: int, seed: int) -> None:
    """Make `engine.generate` cut each completion to a length drawn uniformly from min_len..its length (one
    seeded draw per completion, in order), as if it had stopped there."""
    import random

    from rollout.engine import completion_text
    original, draws = engine.generate, random.Random(seed)

    def generate(prompts, **kwargs):
        completions = []
        for completion in original(prompts, **kwargs):
            length = draws.randint(min(min_len, len(completion.completion_ids)), len(completion.completion_ids))
            ids = completion.completion_ids[:length]
            completions.append(dataclasses.replace(
                completion, completion_ids=ids, text=completion_text(engine.tokenizer, ids),
                logprobs=completion.logprobs[:length],
                finish_reason="stop" if length < len(completion.completion_ids) else completion.finish_reason))
        return completions

    engine.generate = generate


def run_steps(overrides: list[str], *, sync: str = "shared", no_eos: bool = False, on_build=None,
              cut_to: int | None = None) -> dict:
    """Build the trainer from `overrides`, run train_rl instrumented, return per-step reports.

    sync:   "shared" (what one process does: the engine generates with the policy, nothing to sync) or
            "copy" (the engine owns a copy refreshed by rollout.sync.sync_weights, as under torchrun).
    no_eos: the engine never stops early, so every completion has exactly max_new_tokens tokens.
    on_build(parts): called after build, before training (e.g. to reset a peak-memory mark).
    cut_to: with no_eos, cut each completion to a seeded uniform length in cut_to..max_new_tokens
            (`cut_completions`, seeded by cfg.seed).
    """
    import torch

    from grpo.trainer import train_rl
    from launch.build import build
    from launch.dist import init_distributed, shutdown
    from launch.recipe import load_config
    from models import load_model
    from rollout.hf_engine import HFEngine

    cfg = load_config(None, overrides)
    dist = init_distributed()
    try:
        built = build(cfg, dist)
        built.checkpoints.save = lambda step: None  # checkpoints are not part of a step
        parts = built.parts
        if sync == "copy" or no_eos:
            if cfg.rollout.engine != "hf":
                raise ValueError(f"--sync copy / --no-eos need rollout.engine=hf, got {cfg.rollout.engine!r}")
            rollout = parts.rollout
            model, tokenizer = parts.policy.model, rollout.engine.tokenizer
            vocab_rows = model.get_output_embeddings().weight.shape[0]
            # An id past the vocabulary is never sampled, so no completion ends before max_new_tokens.
            eos = [vocab_rows] if no_eos else None
            if sync == "copy" and rollout.engine.shared:
                # The engine's own copy in the compute dtype, as launch.plan gives a sharded run.
                load = dict(dtype=getattr(torch, cfg.model.param_dtype), device=dist.device,
                            attn_implementation=model.config._attn_implementation,
                            trust_remote_code=cfg.model.trust_remote_code)
                rollout.engine = HFEngine(load_model(cfg.model.name_or_path, **load).eval().requires_grad_(False),
                                          tokenizer, shared=False, eos_token_ids=eos)
                rollout.policy = model  # its weights go into the copy after every update (rollout.sync.sync_weights)
                rollout.sync_weights()
            elif eos is not None:
                rollout.engine.eos_token_ids = eos  # the engine the run built (launch.plan), never stopping early
        if cut_to is not None:
            cut_completions(parts.rollout.engine, cut_to, cfg.seed)
        memory = PhaseMemory(cuda=dist.device.type == "cuda")
        generated: list[dict] = []
        parts, hooks = _instrument(parts, memory, generated)
        if on_build is not None:
            on_build(parts)
        started, started_cpu = time.perf_counter(), time.process_time()
        try:
            train_rl(parts, dist)
        finally:
            for hook in hooks:
                hook.remove()
            built.log.close()
            memory.close()
        wall = time.perf_counter() - started
        steps = [_step_report(record, memory, step, cfg.algorithm.ppo_epochs) for step, record in enumerate(generated)]
        logprob_passes = int(cfg.algorithm.ppo_epochs > 1) + int(parts.reference is not None)
        return {"steps": steps, "wall_seconds": wall, "started_at": started, "started_cpu": started_cpu,
                "peak_reset": memory.peak_reset, "ppo_epochs": cfg.algorithm.ppo_epochs, "kl_coef": cfg.algorithm.kl_coef,
                "shape": DecoderShape.of(parts.policy.model).__dict__, "micro_batch_size": cfg.trainer.micro_batch_size,
                "logprob_passes": logprob_passes}
    finally:
        shutdown(dist)


def summarize(steps: list[dict]) -> dict:
    """Median over the steps after the first (the first pays one-time costs); all steps when there is one."""
    measured = steps[1:] if len(steps) > 1 else steps
    summary = {}
    for phase in PHASES:
        entries = [step["phases"][phase] for step in measured]
        rates = [e["rate"] for e in entries if e["rate"] is not None]
        summary[phase] = {
            "seconds": statistics.median(e["seconds"] for e in entries),
            "rate": statistics.median(rates) if rates else None, "rate_unit": entries[0]["rate_unit"],
            "ran": any(e["ran"] for e in entries),
            "peak_rss_bytes": max((e.get("peak_rss_bytes", 0) for e in entries), default=0),
            "extra_rss_bytes": max((e.get("extra_rss_bytes", 0) for e in entries), default=0)}
    summary["step_seconds"] = statistics.median(step["step_seconds"] for step in measured)
    summary["tokens_per_s"] = statistics.median(step["tokens_per_s"] for step in measured)
    summary["measured_steps"] = len(measured)
    return summary


MFU_PHASES = ("prefill", "decode", "logprob", "update", "step")


def mfu_report(result: dict, peak_flops_per_s: float) -> dict:
    """Model FLOPs (bench.flops) and MFU per phase: per step, then the median over the steps after the first.
    prefill: the engine's forwards of more than one token per row; decode: the rest of generate (its forwards,
    sampling and bookkeeping); step: all five phases. Without an HFEngine the rollout is not split."""
    shape = DecoderShape(**result["shape"])
    per_step = []
    for step in result["steps"]:
        flops = dict.fromkeys(MFU_PHASES, 0)
        for call in step["calls"]:
            counted = step_flops(shape, prompts=call["prompts"], group=call["group"],
                                 completion_lengths=call["completion_lengths"],
                                 micro_batch_size=result["micro_batch_size"], ppo_epochs=result["ppo_epochs"],
                                 logprob_passes=result["logprob_passes"])
            flops = {phase: flops[phase] + counted[phase] for phase in MFU_PHASES}
        rollout, prefill = step["phases"]["rollout"]["seconds"], step["prefill_seconds"]
        seconds = {"prefill": prefill, "decode": None if prefill is None else rollout - prefill,
                   "logprob": step["phases"]["logprob"]["seconds"], "update": step["phases"]["update"]["seconds"],
                   "step": step["step_seconds"]}
        per_step.append({phase: {"flops": flops[phase], "seconds": seconds[phase],
                                 "mfu": flops[phase] / seconds[phase] / peak_flops_per_s
                                 if seconds[phase] and flops[phase] else None} for phase in MFU_PHASES})
    measured = per_step[1:] if len(per_step) > 1 else per_step
    summary = {}
    for phase in MFU_PHASES:
        values = [entry[phase] for entry in measured]
        known = [v["mfu"] for v in values if v["mfu"] is not None]
        seconds = [v["seconds"] for v in values if v["seconds"] is not None]
        summary[phase] = {"flops": statistics.median(v["flops"] for v in values),
                          "seconds": statistics.median(seconds) if seconds else None,
                          "mfu": statistics.median(known) if known else None}
    return {"peak_flops_per_s": peak_flops_per_s, "per_step": per_step, "summary": summary}


def print_mfu(report: dict) -> None:
    peak = report["peak_flops_per_s"]
    print(f"\nmodel FLOPs utilisation (peak: {peak / 1e9:.1f} GFLOP/s, a {report.get('peak_size', 2048)}^3 fp32 "
          f"matmul at the same thread count, best of this run)")
    print(f"{'phase':<8} {'seconds':>8} {'GFLOP':>9} {'GFLOP/s':>8} {'MFU':>7}")
    for phase in MFU_PHASES:
        row = report["summary"][phase]
        if row["seconds"] is None or not row["flops"]:
            print(f"{phase:<8} {'-':>8} {row['flops'] / 1e9:>9.1f} {'-':>8} {'-':>7}")
            continue
        print(f"{phase:<8} {row['seconds']:>8.3f} {row['flops'] / 1e9:>9.1f} {row['flops'] / row['seconds'] / 1e9:>8.1f} "
              f"{100 * row['mfu']:>6.1f}%")


def print_table(summary: dict, result: dict) -> None:
    mib = 2**20
    print(f"{'phase':<8} {'seconds':>8} {'rate':>10} {'unit':<20} {'peak RSS MiB':>12} {'extra MiB':>10}")
    for phase in PHASES:
        row = summary[phase]
        rate = f"{row['rate']:.1f}" if row["rate"] is not None else "-"
        note = "" if row["ran"] else "  (no pass: see notes)"
        print(f"{phase:<8} {row['seconds']:>8.3f} {rate:>10} {row['rate_unit']:<20} "
              f"{row['peak_rss_bytes'] / mib:>12.0f} {row['extra_rss_bytes'] / mib:>10.0f}{note}")
    print(f"step     {summary['step_seconds']:>8.3f} {summary['tokens_per_s']:>10.1f} completion tokens/s "
          f"(median of {summary['measured_steps']} step(s) after the first)")
    for note in result["notes"]:
        print(f"note: {note}")


def packed_against_padded(overrides: list[str], args) -> int:
    """--lengths uneven: the trainer with its padded update and with the packed one, alternating, on the same
    cut lengths; prints the update's seconds of each and their ratio, step by step."""
    runs: dict[str, list[dict]] = {"padded": [], "packed": []}
    for round_number in range(args.rounds):
        order = ("padded", "packed") if round_number % 2 == 0 else ("packed", "padded")
        for mode in order:
            runs[mode].append(run_steps(overrides + [f"model.packed_logprobs={mode == 'packed'}"], sync=args.sync,
                                        no_eos=True, cut_to=args.min_len))
    measured = lambda mode: [step for run in runs[mode] for step in run["steps"][1:] or run["steps"]]  # noqa: E731
    update = {mode: [step["phases"]["update"]["seconds"] for step in measured(mode)] for mode in runs}
    lengths = sorted({n for step in measured("padded") for call in step["calls"] for n in call["completion_lengths"]})
    ratios = [packed / padded for packed, padded in zip(update["packed"], update["padded"])]
    tokens = [step["trained_tokens"] for step in measured("padded")]
    summary = {"update_seconds": {mode: statistics.median(values) for mode, values in update.items()},
               "ratio_packed_over_padded": {"median": statistics.median(ratios), "min": min(ratios),
                                            "max": max(ratios), "pairs": len(ratios)},
               "completion_lengths": [lengths[0], lengths[-1]], "trained_tokens_per_step": tokens}
    print(f"update on completions of {lengths[0]}..{lengths[-1]} tokens ({args.prompts} prompts x G={args.group}, "
          f"{args.rounds} round(s), steps after the first): padded {summary['update_seconds']['padded']:.3f} s, "
          f"packed {summary['update_seconds']['packed']:.3f} s (medians); packed/padded per step: median "
          f"{summary['ratio_packed_over_padded']['median']:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f} "
          f"over {len(ratios)} pairs")
    if args.out:
        write_results(args.out, {"runs": runs, "summary": summary,
                                 "settings": {"prompts": args.prompts, "group": args.group, "min_len": args.min_len,
                                              "new_tokens": args.new_tokens, "steps": args.steps,
                                              "rounds": args.rounds, "overrides": args.overrides,
                                              "load_average": os.getloadavg()}})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="model directory, or 'default' (embedded SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=2, help="P: prompts per step")
    parser.add_argument("--group", type=int, default=4, help="G: completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="rollout.max_new_tokens")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", choices=("shared", "copy"), default="shared",
                        help="shared: one-process trainer (engine = policy); copy: engine owns a synced copy")
    parser.add_argument("--no-eos", action="store_true", help="every completion runs to --new-tokens")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--lengths", choices=("model", "uneven"), default="model",
                        help="model: completions as the engine ends them; uneven: cut to --min-len..--new-tokens, "
                             "and the padded update against the packed one")
    parser.add_argument("--min-len", type=int, default=8, help="--lengths uneven: the shortest completion")
    parser.add_argument("--rounds", type=int, default=1, help="--lengths uneven: padded/packed run pairs")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 2 steps, 8 tokens")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("overrides", nargs="*", help="extra trainer config overrides, key.sub=value")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 2)
        args.new_tokens = min(args.new_tokens, 32 if args.lengths == "uneven" else 8)
    if args.lengths == "uneven" and not 1 <= args.min_len <= args.new_tokens:
        parser.error(f"--min-len must be in 1..--new-tokens ({args.new_tokens}), got {args.min_len}")

    import torch

    from data.rows import write_rows
    from data.synthetic import generate_rows

    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="nanogrpo-bench-step-") as work:
        work_dir = Path(work)
        model = prepare_model(args.model, args.quick, work_dir)
        rows_file = work_dir / "rows.jsonl"
        write_rows(generate_rows(max(args.prompts * args.steps, 8), seed=args.seed), rows_file)
        overrides = trainer_overrides(model, rows_file, work_dir / "runs", prompts=args.prompts, group=args.group,
                                      new_tokens=args.new_tokens, steps=args.steps, lr=args.lr, seed=args.seed)
        if args.lengths == "uneven":
            return packed_against_padded(overrides + list(args.overrides), args)
        peaks = [measure_peak_flops()]  # the machine's peak, before and after the steps (the better counts)
        result = run_steps(overrides + list(args.overrides), sync=args.sync, no_eos=args.no_eos)
        peaks.append(measure_peak_flops())
    notes = []
    if result["ppo_epochs"] == 1 and result["kl_coef"] == 0:
        notes.append("logprob: no pass runs (ppo_epochs=1: old logprobs are the update's own, detached; kl_coef=0: "
                     "no reference model); its seconds are the trainer's timer around nothing")
    if args.sync == "shared":
        notes.append("sync: one process, the engine generates with the policy itself: nothing to sync "
                     "(--sync copy times the torchrun path, a separate engine copy)")
    if not result["peak_reset"]:
        notes.append("peak RSS could not be reset per phase (/proc/self/clear_refs): figures are process peaks so far")
    notes.append("peak RSS: the process's resident high-water mark within the phase (weights, optimizer state and "
                 "allocator caches included); extra: that peak minus the RSS when the phase began")
    result["notes"] = notes
    result["summary"] = summarize(result["steps"])
    result["settings"] = {"model": args.model if not args.quick else "tiny random llama (quick)",
                          "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
                          "steps": args.steps, "lr": args.lr, "sync": args.sync, "no_eos": args.no_eos,
                          "overrides": args.overrides, "torch_threads": torch.get_num_threads(),
                          "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    result["mfu"] = mfu_report(result, max(peak["flops_per_s"] for peak in peaks))
    result["mfu"]["peaks"] = peaks
    print_table(result["summary"], result)
    print_mfu(result["mfu"])
    if args.out:
        write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
