"""Three RL steps of the trainer itself (launch.train) on one device: bf16 compute over fp32 master weights, the
transformers engine on its own bf16 copy, truncated IS; first in one process, then under torchrun with one rank
(NCCL on CUDA: the FSDP2 path of a multi-GPU node), then, where vLLM imports, with the vLLM engine under torchrun.
Part of bench/gpu.sh; what cannot run (vLLM missing) is reported as SKIPPED.

    python -m bench.gpu_rl --out part.json [--device cuda]          # a Qwen3-0.6B-shaped random model
    python -m bench.gpu_rl --out part.json --device cpu --tiny      # the CPU smoke run of the same commands

The model has random weights and an offline word-level tokenizer (bench/gpu_common.py): nothing is downloaded.
Each run's per-step metrics (phase times, logprob gap, IS weights, sync figures) go into the JSON.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Qwen3-0.6B's architecture: small enough to save, load twice (policy and engine copy) and step three times per
# run within the script's time limit.
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128)
KEYS = ("reward_mean", "logprob_gap", "tis_weight_mean", "tis_clip_frac", "grad_norm", "time_rollout_reward",
        "time_logprob", "time_update", "time_sync", "sync/seconds", "sync/bytes", "tokens_per_s", "trained_tokens")


def reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The benchmark's reward: the fraction of even token ids in the completion ("<12> <7> ..."), which varies
    within every group of random completions, so every step has advantages to train on."""
    ids = [word[1:-1] for word in solution_str.split() if word.startswith("<") and word.endswith(">")]
    return sum(int(i) % 2 == 0 for i in ids if i.isdigit()) / len(ids) if ids else 0.0


def write_model_and_rows(directory: Path, tiny: bool, prompts: int, prompt_len: int) -> None:
    from bench.gpu_common import QWEN3_1_7B, TINY, offline_tokenizer
    from data.rows import write_rows
    from transformers import AutoModelForCausalLM, Qwen3Config

    from bench.gpu_common import EOS_ID, PAD_ID
    shape = dict(TINY) if tiny else dict(QWEN3_1_7B, **QWEN3_0_6B)
    config = Qwen3Config(**shape, use_sliding_window=False, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
                         pad_token_id=PAD_ID)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory / "model")
    tokenizer = offline_tokenizer(config.vocab_size)
    tokenizer.save_pretrained(directory / "model")
    generator = torch.Generator().manual_seed(0)
    rows = [{"prompt": [{"role": "user", "content": " ".join(
        f"<{i}>" for i in torch.randint(2, config.vocab_size, (prompt_len,), generator=generator).tolist())}],
        "data_source": "gpu_bench", "reward_model": {"ground_truth": ""}, "extra_info": {"index": index}}
        for index in range(4 * prompts)]
    write_rows(rows, directory / "rows.jsonl")


def run_training(name: str, launcher: list[str], directory: Path, overrides: list[str], limit_s: float) -> dict:
    """One launch.train run; its exit code, wall time, the tail of its stderr, and every step's KEYS."""
    run_dir = directory / "runs" / name
    command = [*launcher, "-m", "launch.train", *overrides, f"trainer.out_dir={directory / 'runs'}",
               f"trainer.run_name={name}"]
    from bench.gpu_common import run_limited
    started = time.perf_counter()
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    finished = run_limited(command, limit_s, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    result = {"command": " ".join(command[len(launcher):]), "returncode": finished.returncode,
              "seconds": time.perf_counter() - started, "stderr_tail": finished.stderr[-1500:]}
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        steps = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
        result["steps"] = [{key: step[key] for key in ("step", *KEYS) if key in step} for step in steps]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_rl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke run)")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM run even where vLLM imports")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (G = 4 completions each)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--limit-s", type=float, default=450,
                        help="time for all runs; each gets an equal share of what the ones before it left")
    args = parser.parse_args(argv)
    from bench.gpu_common import Results, environment
    device = torch.device(args.device)
    results = Results(args.out, "rl")
    results.record("environment", environment(device))
    if device.type == "cuda" and not torch.cuda.is_available():
        results.skip("rl", "no CUDA device visible")
        return 0
    python = sys.executable
    torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                f"--master_port={29500 + os.getpid() % 1000}"]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        started = time.perf_counter()
        write_model_and_rows(directory, args.tiny, args.prompts, args.prompt_len)
        results.record("model_write_seconds", time.perf_counter() - started)
        overrides = [f"model.name_or_path={directory / 'model'}", f"data.train_files=['{directory / 'rows.jsonl'}']",
                     "reward.functions={gpu_bench: 'bench.gpu_rl:reward'}", "model.dtype=float32",
                     "model.param_dtype=bfloat16", "algorithm.tis_cap=2.0", "rollout.n=4",
                     f"rollout.max_new_tokens={args.new_tokens}", f"trainer.prompts_per_step={args.prompts}",
                     f"trainer.micro_batch_size={4 * args.prompts}", "trainer.steps=3", "optim.lr=1e-6",
                     f"data.max_prompt_tokens={args.prompt_len + 16}"]
        runs = [("one_process", [python], overrides),
                ("torchrun_1_rank", torchrun, overrides)]
        if args.no_vllm:
            results.skip("vllm_run", "--no-vllm")
        elif importlib.util.find_spec("vllm") is None:
            results.skip("vllm_run", "vLLM is not installed")
        else:
            # Eager: CUDA-graph capture from a cold cache alone can take a minute.
            runs.append(("vllm_torchrun_1_rank", torchrun, overrides + ["rollout.engine=vllm",
                                                                         "rollout.enforce_eager=true"]))
        deadline = time.monotonic() + args.limit_s
        for index, (name, launcher, run_overrides) in enumerate(runs):
            limit_s = (deadline - time.monotonic()) / (len(runs) - index)
            try:
                result = run_training(name, launcher, directory, run_overrides, limit_s)
            except subprocess.TimeoutExpired:
                results.error(name, TimeoutError(f"{name} did not finish within {limit_s:.0f} s"))
                continue
            results.record(name, result)
            last = (result.get("steps") or [{}])[-1]
            print(f"{name}: exit {result['returncode']}, {result['seconds']:.1f} s, {len(result.get('steps', []))} "
                  f"steps; last step: " + ", ".join(f"{k} {v:.4g}" for k, v in last.items() if k != "step"), flush=True)
            if result["returncode"] != 0:
                results.error(name, RuntimeError(f"exit {result['returncode']}: {result['stderr_tail'][-400:]}"))
            # The checkpoint at the end (fp32 weights + AdamW state) is the largest file: free the disk at once.
            for checkpoint in (directory / "runs" / name / "checkpoints").glob("step_*"):
                subprocess.run(["rm", "-rf", str(checkpoint)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
