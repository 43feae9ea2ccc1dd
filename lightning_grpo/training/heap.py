"""During a fit on a CPU, keep the memory a train step frees for the next step, instead of handing it back to the
system and faulting it in again.

A train step allocates and frees the same large tensors every step: the logits, the bf16 copy of a tied LM head
under autocast, the embedding's gradient. glibc's malloc serves each block over 32 MiB with a mapping of its own and
unmaps it when freed, so the next step faults every page of it in again, each zero-filled by the kernel.
`FitHeap.apply` turns that off for the fit (every block from the heap, `mallopt(M_MMAP_MAX, 0)`, and the heap's
freed top kept, `M_TRIM_THRESHOLD` at its maximum); `restore` hands the freed memory back (`malloc_trim`) and
leaves malloc where glibc's own adjustment takes a process that freed large blocks: blocks over 32 MiB mapped
(`M_MMAP_THRESHOLD`), a freed top over 64 MiB trimmed. (glibc stops adjusting those by itself once any of them is
set, so its start-up values would leave every block over 128 KiB mapped for the rest of the process.) Between steps
the process keeps what a step used, and its peak can be higher (blocks of new sizes do not always fit the freed ones).

Only with glibc (Linux); elsewhere nothing changes. `LIGHTNING_GRPO_KEEP_FREED_MEMORY=0` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from typing import Any

log = logging.getLogger(__name__)

#: Set to "0" to leave malloc as it is.
ENV_SWITCH = "LIGHTNING_GRPO_KEEP_FREED_MEMORY"
# mallopt's parameters (malloc.h); glibc's default count of mappings, and the ceilings its own adjustment of the mmap
# and trim thresholds reaches (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, and twice that).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX, _ADJUSTED_MMAP_THRESHOLD, _ADJUSTED_TRIM_THRESHOLD = 65536, 32 * 2**20, 64 * 2**20
_KEEP_ALL = 2**31 - 1  # mallopt takes an int


class FitHeap:
    """glibc's malloc keeping freed memory for the duration of a fit (see the module docstring)."""

    def __init__(self) -> None:
        self._applied = False

    @property
    def applied(self) -> bool:
        """Whether malloc keeps freed memory now (between `apply` and `restore`)."""
        return self._applied

    def apply(self, *, on_cpu: bool) -> None:
        """Keep freed memory from now on, when the fit trains `on_cpu`, the C library is glibc and the switch is on."""
        libc = _glibc()
        if self._applied or not on_cpu or libc is None or os.environ.get(ENV_SWITCH, "1") == "0":
            return
        if libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_ALL):
            self._applied = True
            log.info("Keeping the memory each train step frees for the next (%s=0 leaves malloc as it is).", ENV_SWITCH)

    def restore(self) -> None:
        """Blocks over 32 MiB mapped again and a freed top over 64 MiB trimmed (see the module docstring), and the
        memory the heap kept handed back."""
        if not self._applied:
            return
        libc = _glibc()
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_MMAP_THRESHOLD, _ADJUSTED_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _ADJUSTED_TRIM_THRESHOLD)
        libc.malloc_trim(0)
        self._applied = False


def _glibc() -> Any:
    """This process's C library when it is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc
