"""Keeping freed memory for reuse while training on a CPU (glibc's `malloc`).

glibc serves every allocation larger than its mmap threshold (32 MB at most) with a fresh `mmap` and unmaps it when
it is freed, so a tensor that large is new memory every time it is made: the kernel faults in and zeroes each of its
pages again. A train step makes several per micro-batch (a policy with a large vocabulary: the tied embedding's
gradient, its bf16 copy under autocast, the head's products), and on a CPU those page faults can take a fifth of
the step. `reuse_freed_memory` tells glibc to serve large blocks from its heap and never give the heap's top back,
so those pages are faulted in once and reused by every later step, as jemalloc and tcmalloc (which PyTorch's CPU
tuning guide recommends preloading) do by default.

The cost: the process keeps the memory of its largest step until it exits, instead of returning it between steps.
The setting is process-wide and cannot be undone (glibc has no way back to its adaptive thresholds).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Literal

CpuAllocator = Literal["reuse", "system"]
CPU_ALLOCATORS = ("reuse", "system")

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
#: The largest trim threshold `mallopt` takes (an int): freed memory at the heap's top is never given back.
_NEVER_TRIM = 2**31 - 1

_applied: str | None = None


def reuse_freed_memory() -> str:
    """Make glibc keep freed memory for reuse (large blocks from its heap, which it never trims); once per process.

    Returns:
        what was done, for the log: applied (or already applied), or why not (not Linux with glibc, or `mallopt`
        refused) — elsewhere the system's allocator is left as it is.
    """
    global _applied
    if _applied is not None:
        return _applied
    mallopt = _glibc_mallopt()
    if mallopt is None:
        _applied = f"left the system allocator as it is ({platform.system()} without glibc)"
    elif mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1:
        _applied = "glibc keeps freed memory for reuse (large blocks from its heap, never trimmed)"
    else:
        _applied = "left glibc's allocator as it is (mallopt refused the settings)"
    return _applied


def _glibc_mallopt():
    """glibc's `mallopt`, or None on another C library or system."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
