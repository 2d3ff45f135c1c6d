"""Rollout tokens/s of the transformers engine (rollout.hf_engine.HFEngine) and, where vLLM is installed, of
the vLLM engine (rollout.vllm_engine.VLLMEngine) with the weight-sync time from an FSDP2-sharded policy into
it, for a Qwen3-1.7B-shaped model with random weights. Part of bench/gpu.sh; CPU-tiny for the smoke test.

    python -m bench.gpu_rollout --out part.json [--prompts 16 --group 4 --prompt-len 256 --new-tokens 256]
    python -m bench.gpu_rollout --device cpu --tiny --no-vllm --out part.json

Every completion runs to --new-tokens (HFEngine: an end-of-sequence id that is never sampled; vLLM: a random
model's chance of sampling EOS is about 1/V per token; generated tokens are counted, not assumed). Prompts are
random ids; the tokenizer is an offline word-level one over the model's ids (bench/gpu_common.py). Sync:
rollout.sync.sync_weights (full tensors gathered from the shards, fed to the engine in buckets), the
trainer's own path after every optimizer step, timed --sync-repeats times.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time

import torch


def _prompts(vocab_size: int, count: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab_size, (count, length), generator=generator).tolist()


def _timed_generate(engine, prompts, args, device) -> dict:
    from bench.gpu_common import synchronize

    sampling = dict(n=args.group, temperature=1.0, top_p=1.0, top_k=0, stop=None, seed=0)
    engine.generate(prompts[:1], max_new_tokens=min(8, args.new_tokens), **sampling)  # warm-up
    synchronize(device)
    started = time.perf_counter()
    completions = engine.generate(prompts, max_new_tokens=args.new_tokens, **sampling)
    synchronize(device)
    seconds = time.perf_counter() - started
    generated = sum(len(c.completion_ids) for c in completions)
    return {"seconds": seconds, "sequences": len(completions), "generated_tokens": generated,
            "tokens_per_s": generated / seconds, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}


def measure_hf(args, device: torch.device, attn: str, tokenizer) -> dict:
    from bench.gpu_common import build_model
    from rollout.hf_engine import HFEngine

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.tiny, device, dtype, attn).eval()
    vocab_rows = model.get_output_embeddings().weight.shape[0]
    engine = HFEngine(model, tokenizer, shared=True, eos_token_ids=[vocab_rows])  # never sampled: full length
    result = _timed_generate(engine, _prompts(len(tokenizer), args.prompts, args.prompt_len), args, device)
    result.update(dtype=str(dtype), attention=attn)
    del engine, model
    return result


def measure_vllm(args, device: torch.device, tokenizer, work_dir: str, results) -> None:
    """Build the policy (fp32 master, FSDP2 over one rank), save it for vLLM, generate, then time syncs."""
    from bench.gpu_common import build_model, one_rank_mesh
    from models.fsdp import shard
    from rollout.sync import sync_weights
    from bench.gpu_common import vllm_engine

    policy = build_model(args.tiny, device, torch.float32, "sdpa")
    engine_dtype = "bfloat16" if device.type == "cuda" else "float32"
    policy.to(getattr(torch, engine_dtype)).save_pretrained(work_dir)
    policy.to(torch.float32)
    tokenizer.save_pretrained(work_dir)
    mesh = one_rank_mesh(device)  # before vLLM: it joins this group through the external launcher
    shard(policy, mesh, param_dtype=torch.bfloat16 if device.type == "cuda" else None)
    started = time.perf_counter()
    # The trainer's plan for these settings (launch.plan.vllm_arguments): CUDA graphs on, no KV-cache byte cap.
    engine = vllm_engine(work_dir, f"model.param_dtype={engine_dtype}",
                         f"rollout.max_model_len={args.prompt_len + args.new_tokens + 8}",
                         f"rollout.vllm_gpu_memory_utilization={args.vllm_gpu_memory_utilization}")
    results.record("vllm_init_seconds", time.perf_counter() - started)
    rollout = _timed_generate(engine, _prompts(len(tokenizer), args.prompts, args.prompt_len), args, device)
    results.record("vllm_rollout", rollout)
    print(f"vLLM rollout: {rollout['tokens_per_s']:.0f} tokens/s ({rollout['sequences']} sequences x "
          f"{args.new_tokens} new tokens)", flush=True)
    syncs = []
    for _ in range(args.sync_repeats):
        syncs.append(sync_weights(policy, engine, bucket_bytes=args.bucket_mb << 20))
    seconds = [info["sync/seconds"] for info in syncs]
    results.record("vllm_sync", {"seconds_median": statistics.median(seconds), "seconds": seconds,
                                 "bytes": syncs[-1]["sync/bytes"], "buckets": syncs[-1]["sync/buckets"],
                                 "load_seconds": [info["sync/load_seconds"] for info in syncs],
                                 "bucket_mb": args.bucket_mb})
    print(f"weight sync into vLLM: {statistics.median(seconds):.2f} s median of {len(seconds)} "
          f"({syncs[-1]['sync/bytes'] / 2**30:.2f} GiB)", flush=True)


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_common import Results, attention, environment, model_config, offline_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny width, same vocabulary (CPU smoke runs)")
    parser.add_argument("--prompts", type=int, help="prompts per generate (default 16; --tiny 2)")
    parser.add_argument("--group", type=int, help="completions per prompt (default 4; --tiny 2)")
    parser.add_argument("--prompt-len", type=int, help="default 256; --tiny 8")
    parser.add_argument("--new-tokens", type=int, help="default 256; --tiny 4")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM measurements")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--bucket-mb", type=int, default=1024, help="weight-sync bucket (rollout.sync_bucket_mb)")
    parser.add_argument("--sync-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    defaults = dict(prompts=2, group=2, prompt_len=8, new_tokens=4) if args.tiny else \
        dict(prompts=16, group=4, prompt_len=256, new_tokens=256)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    results = Results(args.out, "rollout")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        for key in ("hf_rollout", "vllm_rollout", "vllm_sync"):
            results.skip(key, "no CUDA device")
        return 0
    attn, _ = attention(device)
    results.record("environment", environment(device))
    tokenizer = offline_tokenizer(model_config(args.tiny).vocab_size)
    try:
        hf = measure_hf(args, device, attn, tokenizer)
        results.record("hf_rollout", hf)
        print(f"transformers engine rollout: {hf['tokens_per_s']:.0f} tokens/s ({hf['sequences']} sequences x "
              f"{args.new_tokens} new tokens)", flush=True)
    except Exception as error:
        results.error("hf_rollout", error)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.no_vllm:
        for key in ("vllm_rollout", "vllm_sync"):
            results.skip(key, "--no-vllm")
    elif importlib.util.find_spec("vllm") is None:
        for key in ("vllm_rollout", "vllm_sync"):
            results.skip(key, "vllm is not installed")
    else:
        with tempfile.TemporaryDirectory(prefix="nanogrpo-gpu-vllm-") as work_dir:
            try:
                measure_vllm(args, device, tokenizer, work_dir, results)
            except Exception as error:
                results.error("vllm", error)
            # The process group is left to vLLM's own shutdown at exit: destroying it first makes that
            # shutdown raise "Invalid process group specified".
    return 1 if results.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
