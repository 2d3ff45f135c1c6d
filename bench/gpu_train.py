"""Training-step MFU of a Qwen3-1.7B-shaped model (random weights) under FSDP2 over one rank, and the memory
of a logprob pass (models.logprobs.completion_logprobs against the naive full-logits log_softmax) at
V = 151,936. Part of bench/gpu.sh; runs on CPU with tiny shapes for the smoke test.

    python -m bench.gpu_train --out part.json [--peak-tflops 989] [--batch 4] [--seq-len 2048]
    python -m bench.gpu_train --device cpu --tiny --out part.json

The step is the trainer's: fp32 master weights sharded by models.fsdp.shard (bf16 compute on CUDA through
FSDP2 mixed precision, gradients reduced in fp32), completion_logprobs, grpo.losses.policy_loss with random
advantages, clip_grad_norm_, AdamW. MFU = training_flops (bench/gpu_common.py, formula there) / step seconds
/ peak; the H200's dense bf16 peak is 989 TFLOP/s (--peak-tflops for another GPU).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _batch(config, batch: int, seq_len: int, prompt_len: int, device: torch.device) -> dict:
    """Random prompt and completion ids laid out by models.logprobs.pad_batch (one sequence per row)."""
    from models.logprobs import pad_batch

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, config.vocab_size, (batch, prompt_len), generator=generator).tolist()
    completions = torch.randint(2, config.vocab_size, (batch, seq_len - prompt_len), generator=generator).tolist()
    layout = pad_batch(prompts, completions, pad_id=0)
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in layout.items()}


def measure_mfu(args, device: torch.device, mesh, attn: str) -> dict:
    from bench.gpu_common import PeakMemory, build_model, synchronize, training_flops
    from grpo.losses import policy_loss
    from models.fsdp import shard
    from models.logprobs import completion_logprobs

    model = build_model(args.tiny, device, torch.float32, attn)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compute_dtype = torch.bfloat16 if device.type == "cuda" else None  # CPU bf16 matmuls are slow: fp32 there
    shard(model, mesh, param_dtype=compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # as launch/build.py builds it
    batch = _batch(model.config, args.batch, args.seq_len, args.prompt_len, device)
    mask = batch["completion_mask"].float()
    advantages = torch.randn(args.batch, device=device)
    denominator = mask.sum()

    def step():
        logprobs, _ = completion_logprobs(model, batch, chunk_size=args.chunk_size)
        loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask, denominator=denominator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    with PeakMemory(device) as peak:
        for _ in range(args.steps):
            synchronize(device)
            started = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    counts = training_flops(model.config, batch=args.batch, seq_len=args.seq_len,
                            completion_len=args.seq_len - args.prompt_len)
    peak_flops = args.peak_tflops * 1e12
    result = {"step_seconds_median": seconds, "step_seconds": times, "tokens_per_s": args.batch * args.seq_len / seconds,
              "achieved_tflops": counts["flops"] / seconds / 1e12, "mfu": counts["flops"] / seconds / peak_flops,
              "mfu_causal_attention": (counts["flops"] - counts["attention_causal"]) / seconds / peak_flops,
              "mfu_six_n": counts["six_n"] / seconds / peak_flops, "flops_per_step": counts["flops"],
              "body_params": counts["body_params"], "total_params": counts["total_params"],
              "counted_params": sum(p.numel() for p in model.parameters()),
              "peak_extra_memory_bytes_in_steps": peak.extra_bytes, "peak_tflops": args.peak_tflops,
              "shape": {"batch": args.batch, "seq_len": args.seq_len, "prompt_len": args.prompt_len},
              "compute_dtype": str(compute_dtype or torch.float32), "attention": attn,
              "gradient_checkpointing": args.gradient_checkpointing}
    if device.type == "cuda":
        result["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return result


def naive_logprobs(model, batch: dict) -> torch.Tensor:
    """The textbook pass: full logits [B, Lp+T, V], log_softmax in fp32, gather the completion tokens."""
    prompt_len = int(batch["prompt_len"])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["input_ids"][:, prompt_len:]
    selected = logits[:, prompt_len - 1: -1].float().log_softmax(dim=-1)
    return selected.gather(-1, labels[..., None])[..., 0] * batch["completion_mask"]


def measure_logprob_memory(args, device: torch.device, attn: str) -> dict:
    """Peak extra memory and time of both passes, without and with backward, on a plain (unsharded) model in
    the compute dtype; values compared on the no-grad pass."""
    from bench.gpu_common import PeakMemory, build_model, synchronize
    from models.logprobs import completion_logprobs

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.tiny, device, dtype, attn).eval()
    batch = _batch(model.config, args.batch, args.seq_len, args.prompt_len, device)
    passes = {"chunked": lambda: completion_logprobs(model, batch, chunk_size=args.chunk_size)[0],
              "naive": lambda: naive_logprobs(model, batch)}
    result, values = {"vocab": model.config.vocab_size, "batch": args.batch, "seq_len": args.seq_len,
                      "completion_len": args.seq_len - args.prompt_len, "dtype": str(dtype)}, {}
    for grad in (False, True):
        for name, run in passes.items():
            if device.type == "cuda":
                run()  # warm-up: kernels and the caching allocator's pools, so the peak is the pass's own
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(grad), PeakMemory(device) as peak:
                started = time.perf_counter()
                logprobs = run()
                if grad:
                    logprobs.sum().backward()
                synchronize(device)
                seconds = time.perf_counter() - started
            if not grad:
                values[name] = logprobs.detach().float()
            model.zero_grad(set_to_none=True)
            del logprobs
            key = f"{name}_{'forward_backward' if grad else 'no_grad'}"
            result[key] = {"peak_extra_bytes": peak.extra_bytes, "seconds": seconds}
    for mode in ("no_grad", "forward_backward"):
        result[f"peak_ratio_{mode}"] = result[f"chunked_{mode}"]["peak_extra_bytes"] / max(
            result[f"naive_{mode}"]["peak_extra_bytes"], 1)
    result["max_abs_diff"] = float((values["chunked"] - values["naive"]).abs().max())
    return result


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_common import Results, attention, close_process_group, environment, one_rank_mesh

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny width, same vocabulary (CPU smoke runs)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4; --tiny 2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; --tiny 64)")
    parser.add_argument("--prompt-len", type=int, help="prompt part of each sequence (default 256; --tiny 16)")
    parser.add_argument("--chunk-size", type=int, help="logprob chunk (default 1024; --tiny 32)")
    parser.add_argument("--warmup", type=int, help="untimed steps (default 2; --tiny 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 5; --tiny 1)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    defaults = dict(batch=2, seq_len=64, prompt_len=16, chunk_size=32, warmup=1, steps=1) if args.tiny else \
        dict(batch=4, seq_len=2048, prompt_len=256, chunk_size=1024, warmup=2, steps=5)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 < args.prompt_len < args.seq_len:
        parser.error(f"--prompt-len must lie in (0, --seq-len={args.seq_len}), got {args.prompt_len}")
    results = Results(args.out, "train")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        results.skip("mfu", "no CUDA device")
        results.skip("logprob_memory", "no CUDA device")
        return 0
    attn, note = attention(device)
    results.record("environment", {**environment(device), "attention": attn, "attention_note": note})
    if note:
        print(f"NOTE: {note}", flush=True)
    try:
        mesh = one_rank_mesh(device)
        mfu = measure_mfu(args, device, mesh, attn)
        results.record("mfu", mfu)
        print(f"MFU {mfu['mfu']:.1%} ({mfu['achieved_tflops']:.1f} TFLOP/s of {args.peak_tflops:g}; "
              f"{mfu['step_seconds_median']:.3f} s per step of {args.batch} x {args.seq_len} tokens)", flush=True)
    except Exception as error:  # keep going: the logprob measurement does not need the sharded model
        results.error("mfu", error)
    finally:
        close_process_group()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        memory = measure_logprob_memory(args, device, attn)
        results.record("logprob_memory", memory)
        for mode in ("no_grad", "forward_backward"):
            print(f"logprob pass ({mode}): chunked {memory[f'chunked_{mode}']['peak_extra_bytes'] / 2**30:.2f} GiB vs "
                  f"naive {memory[f'naive_{mode}']['peak_extra_bytes'] / 2**30:.2f} GiB "
                  f"({memory[f'peak_ratio_{mode}']:.2f}x)", flush=True)
        print(f"logprob values: max |chunked - naive| = {memory['max_abs_diff']:.2e}", flush=True)
    except Exception as error:
        results.error("logprob_memory", error)
    return 1 if results.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
