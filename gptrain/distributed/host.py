"""Host (CPU) memory: keep freed tensor memory in the process for the next step to reuse.

torch's CPU tensors come from the C library's malloc. glibc serves every allocation above its mmap
threshold (adjusted at run time between 128 KiB and 32 MiB) with fresh pages from the kernel and
returns them on free, and shrinks its heap once more than its trim threshold is free at the top.
A training step allocates and frees the same large activations every time, so every step pays
a page fault for each 4 KiB page it touches first: measured on a 2-core AMD EPYC, the bench
config's bf16 step took 277-313 ms with glibc's defaults and 226-251 ms without those faults
(benchmarks/RESULTS.md, "Memory"). `keep_freed_memory()` raises both thresholds, so freed memory
stays mapped in the process (its resident size stays near its peak, as with any caching
allocator) and the next step reuses it. CUDA memory has its own caching allocator and is not affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap; up to 1 GiB free stays mapped


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to KEEP_BYTES for this process; False (and nothing
    changed) where the C library has no mallopt (macOS, Windows)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    )
