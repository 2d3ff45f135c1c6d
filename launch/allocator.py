"""CPU runs: glibc's allocator keeps freed memory inside the process instead of handing it back to the kernel.

Why: by default glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and
returns it with munmap on free, and trims the heap top back to the kernel. A training step allocates and
frees the same large activations, gradients and logit chunks every step, so each step page-faults them in
again (and the kernel zeroes every page). With mmap and trimming off the pages stay mapped: no faults after
the second step, a faster update, a little more peak resident memory (bench/README.md, "Freed memory kept in
the process"). This is what an LD_PRELOADed jemalloc or tcmalloc gives CPU PyTorch, set from inside the process.

Only glibc on Linux has mallopt; elsewhere nothing changes. CUDA memory has its own caching allocator and
is untouched either way.
"""
from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

# The same two settings as environment variables, for a process that cannot call keep_freed_memory itself
# (bench.vs_trl --allocator cached gives them to TRL's process).
ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}

_applied = False


def keep_freed_memory() -> bool:
    """Turn off mmap for large blocks (M_MMAP_MAX=0: they come from the heap, which is reused) and heap
    trimming (M_TRIM_THRESHOLD=-1). Process-wide and permanent; calling it again does nothing. Returns
    whether the setting is in effect (False where the C library has no mallopt, e.g. macOS or musl)."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))
    return _applied
