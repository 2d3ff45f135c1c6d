"""launch/dist.py: with keep_freed_memory, a large tensor freed and allocated again is not page-faulted
in again (glibc reuses the heap block); without it every allocation is a fresh mmap. Each case runs in its
own interpreter, since the setting is process-wide and permanent."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Minor page faults of the last of eight rounds, each allocating, filling and freeing the same three large
# tensors (like a training step's activations): 416 MiB, 106,496 pages of 4 KiB per round.
PROBE = """
import resource, sys, torch
from launch.dist import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "on" else False
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.empty(mib * 2**18, dtype=torch.float32).fill_(1.0) for mib in (256, 64, 96)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, faults[-1])
"""


def last_allocation_faults(mode: str, environment: dict | None = None) -> tuple[bool, int]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT,
                            check=True, env={**os.environ, **(environment or {})})
    applied, faults = result.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    applied, faults_on = last_allocation_faults("on")
    _, faults_off = last_allocation_faults("off")
    assert applied
    assert faults_off > 100_000  # fresh mmaps: every page faulted in again
    assert faults_on < 1_000



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables")
def test_the_environment_variables_make_the_same_setting():
    """launch.dist.MALLOC_ENVIRONMENT (what bench.vs_trl --allocator cached gives TRL's process) does what
    keep_freed_memory does, for a process that never calls it."""
    from launch.dist import MALLOC_ENVIRONMENT as ENVIRONMENT
    applied, faults = last_allocation_faults("off", ENVIRONMENT)
    assert not applied and faults < 1_000
