"""Weight-sync cost against bucket size: the embedded SmolLM2-135M sharded with FSDP2 over 2 CPU processes
(gloo), synced into one engine replica per rank with rollout.sync.sync_weights.

    python -m bench.sync                  # vLLM engine when installed (else HF), buckets 16 MiB .. 1 GiB
    python -m bench.sync --engine hf      # the transformers engine (shared=False copy)
    python -m bench.sync --quick          # smoke run: two bucket sizes, one repeat
    python -m bench.sync --engine hf --engine-dtype bfloat16   # a bf16 engine: fp32 vs bf16 gathers, alternated

Per bucket size it prints the sync time (slowest rank, median of the repeats), the time inside the
engine, the bucket count, the largest bucket, and the peak extra resident memory of a rank during the
sync (the high-water mark, reset just before, minus the resident size before): what the bound on the
bucket is for. The children run with MALLOC_MMAP_THRESHOLD_ so freed tensors leave the resident set at
once and the figure tracks live memory rather than malloc's cache.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20


def status_mib(key: str) -> float:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"/proc/self/status has no {key} line")


def reset_peak() -> None:
    # Writing 5 to clear_refs resets the VmHWM high-water mark to the current resident size (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def child(args) -> None:
    """One torchrun rank: shard the policy, build the engine, time sync_weights per bucket size."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models import fsdp, load_model, load_tokenizer, resolve_model_dir
    from rollout.sync import sync_weights

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        resolve_model_dir(None)
    dist.barrier()
    model_dir = resolve_model_dir(None)
    if args.engine == "vllm":
        from bench.gpu_common import vllm_engine

        engine = vllm_engine(model_dir, "rollout.max_model_len=512", world_size=world_size, dp_rank=rank)
    else:
        from rollout.hf_engine import HFEngine

        engine_dtype = getattr(torch, args.engine_dtype)
        engine = HFEngine(load_model(model_dir, dtype=engine_dtype), load_tokenizer(model_dir), shared=False)
    policy = fsdp.shard(load_model(model_dir), init_device_mesh("cpu", (world_size,)), param_dtype=None)
    sync_weights(policy, engine, bucket_bytes=1 << 30)  # warm-up: first-call costs are not the bucket's
    # A bf16 engine: the fp32 masters gathered as stored, then in the engine's dtype, repeats alternated.
    gathers = [None, torch.bfloat16] if args.engine_dtype == "bfloat16" else [None]
    rows = []
    for bucket_mib in args.buckets:
        runs = {gather: {"seconds": [], "load_seconds": [], "peaks": []} for gather in gathers}
        for _ in range(args.repeats):
            for gather, run in runs.items():
                dist.barrier()
                before = status_mib("VmRSS")
                reset_peak()
                metrics = sync_weights(policy, engine, bucket_bytes=bucket_mib * MIB, dtype=gather)
                run["peaks"].append(status_mib("VmHWM") - before)
                run["seconds"].append(metrics["sync/seconds"])
                run["load_seconds"].append(metrics["sync/load_seconds"])
                run["metrics"] = metrics
        for gather, run in runs.items():
            rows.append({
                "bucket_mib": bucket_mib, "gather": str(gather or "float32").removeprefix("torch."),
                "seconds": statistics.median(run["seconds"]), "load_seconds": statistics.median(run["load_seconds"]),
                "buckets": run["metrics"]["sync/buckets"], "peak_extra_mib": max(run["peaks"]),
                "max_bucket_mib": run["metrics"]["sync/max_bucket_bytes"] / MIB,
                "model_mib": run["metrics"]["sync/bytes"] / MIB,
            })
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()
    del engine
    try:
        dist.destroy_process_group()
    except (AssertionError, RuntimeError, ValueError):
        pass  # a vLLM external-launcher engine may already have torn the default group down


def launch(args) -> None:
    """Run this module under torchrun with 2 processes and print rank 0's table."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "sync.json"
        torchrun = Path(sys.executable).with_name("torchrun")
        command = [str(torchrun), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                   "-m", "bench.sync", "--child", "--out", str(out), "--engine", args.engine,
                   "--repeats", str(args.repeats), "--engine-dtype", args.engine_dtype,
                   "--buckets", *[str(size) for size in args.buckets]]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                       "MALLOC_MMAP_THRESHOLD_": "65536"}
        finished = subprocess.run(command, env=environment, capture_output=True, text=True)
        if finished.returncode != 0:
            sys.exit(f"torchrun failed ({finished.returncode}):\n{finished.stderr[-6000:]}")
        ranks = json.loads(out.read_text())
    print(f"engine {args.engine} ({args.engine_dtype}), 2 ranks (FSDP2, gloo), fp32 master weights, "
          f"median of {args.repeats}")
    print(f"{'bucket MiB':>10} {'gathered':>8} {'MiB moved':>9} {'buckets':>7} {'largest MiB':>11} {'sync s':>7} "
          f"{'engine s':>8} {'peak extra MiB (rank 0, 1)':>27}")
    for row, other in zip(ranks[0], ranks[1]):
        seconds = max(row["seconds"], other["seconds"])
        print(f"{row['bucket_mib']:>10} {row['gather']:>8} {row['model_mib']:>9.0f} {row['buckets']:>7.0f} "
              f"{row['max_bucket_mib']:>11.0f} {seconds:>7.2f} {row['load_seconds']:>8.2f} "
              f"{row['peak_extra_mib']:>13.0f} {other['peak_extra_mib']:>13.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    parser.add_argument("--engine", choices=["vllm", "hf"], default=default_engine)
    parser.add_argument("--buckets", type=int, nargs="+", default=[16, 64, 256, 1024], help="bucket sizes, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the hf engine's dtype; bfloat16 also times gathering in it")
    parser.add_argument("--quick", action="store_true", help="smoke run: buckets 64 and 1024 MiB, one repeat")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.buckets, args.repeats = [64, 1024], 1
    if args.child:
        child(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
