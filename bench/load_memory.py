"""Per-rank peak host memory while the trainer loads its model on 2 ranks (FSDP2, gloo, CPU): every rank
reading the whole model and then sharding it (the simple way) against rank-0 loading onto meta devices
(models.fsdp.load_sharded_model, what launch/build.py does).

    python -m bench.load_memory            # the embedded SmolLM2-135M, float32 master weights

Each way runs in its own torchrun launch, so each rank's high-water mark (VmHWM) is that way's alone; the
table gives each rank's peak and its resident size once the model is sharded. The children run with
MALLOC_MMAP_THRESHOLD_ so freed tensors leave the resident set at once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.sync import status_mib

WAYS = ("full_then_shard", "rank0_meta")


def child(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from models import fsdp, load_model, resolve_model_dir

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        resolve_model_dir(None)  # unpacks the embedded GGUF once, before the other rank looks
    dist.barrier()
    mesh = init_device_mesh("cpu", (world_size,))
    import_mib = status_mib("VmRSS")  # torch and transformers imported, nothing loaded
    if args.way == "full_then_shard":
        model = fsdp.shard(load_model(None, dtype=torch.float32), mesh, param_dtype=None)
    else:
        model = fsdp.load_sharded_model(None, mesh, param_dtype=None, dtype=torch.float32)
    dist.barrier()
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / (1 << 20)
    row = {"rank": rank, "before_mib": import_mib, "peak_mib": status_mib("VmHWM"), "after_mib": status_mib("VmRSS"),
           "shard_mib": local}
    rows = [None] * world_size
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def launch(way: str) -> list[dict]:
    from bench.gpu_common import free_port
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "rows.json"
        command = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}", "-m", "bench.load_memory", "--child", way, "--out", str(out)]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                       "MALLOC_MMAP_THRESHOLD_": "65536"}
        finished = subprocess.run(command, env=environment, capture_output=True, text=True)
        if finished.returncode != 0:
            sys.exit(f"torchrun ({way}) failed ({finished.returncode}):\n{finished.stderr[-6000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.way = args.child
        child(args)
        return
    print(f"{'way':<16} {'rank':>4} {'before MiB':>10} {'peak MiB':>9} {'after MiB':>9} {'own shard MiB':>13}")
    results = {}
    for way in WAYS:
        results[way] = launch(way)
        for row in results[way]:
            print(f"{way:<16} {row['rank']:>4} {row['before_mib']:>10.0f} {row['peak_mib']:>9.0f} "
                  f"{row['after_mib']:>9.0f} {row['shard_mib']:>13.0f}")
    from bench.report import write_results
    write_results("bench/results/load_memory.json", results)


if __name__ == "__main__":
    main()
