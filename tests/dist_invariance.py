"""One RL step through grpo.trainer.train_rl on 2 ranks (FSDP2, gloo), run by tests/test_loop_invariance.py as
`torchrun --nproc_per_node=2 tests/dist_invariance.py OUT_DIR MODEL_DIR ROWS [CASE ...]`; each case of
loop_harness.CASES (or those named) runs with P = 2 prompts per rank, micro-batches of 2, and rank 0 saves the weights after
the step to OUT_DIR/<case>.safetensors and the logged metrics to results.json. The pytest side compares them
with 1 process x 4 prompts."""
from __future__ import annotations

import sys
import time

from safetensors.torch import save_file

from launch.dist import init_distributed
from loop_harness import CASES, case_overrides, run_case
from tests_support import run_under_torchrun


def run_cases(mesh, shared) -> dict:
    out_dir, model_dir, rows = sys.argv[1], sys.argv[2], sys.argv[3]
    dist = init_distributed()
    results = {}
    for case in sys.argv[4:] or CASES:
        started = time.perf_counter()
        weights, metrics = run_case(case_overrides(case, dist.world_size, model_dir, rows, shared), dist)
        print(f"rank {dist.rank} {case}: {time.perf_counter() - started:.1f} s", flush=True)
        if dist.rank == 0:
            save_file({k: v.contiguous() for k, v in weights.items()}, f"{out_dir}/{case}.safetensors")
        results[case] = metrics
    return results


if __name__ == "__main__":
    run_under_torchrun(run_cases)
