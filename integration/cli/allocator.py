"""glibc malloc settings for `dgr2`'s long CPU jobs: freed memory stays in the process's heap.

PyTorch's CPU tensors come from glibc malloc. By default an allocation above the mmap threshold
(at most 32 MiB) is a fresh mmap, given back to the kernel when freed, and the top of the heap is
trimmed, so each training step's large activations and logits fault in newly zeroed pages, and
the two torch threads queue on the kernel's memory-map lock while they do. In a Beauty SFT run the
kernel's share of the CPU time grew to about a quarter and only 1.6 of the 2 cores were busy; with
no mmap'd chunks and no trimming, the heap is reused, the kernel's share was under 1% and a step
went from 5 s to 3 s (docs/EXPERIMENTS.md, "Freed memory kept in the heap"). The price: the
process keeps its peak heap (it only grows when a step needs more than any step before).

`dgr2` applies this at start-up unless DGR2_MALLOC=system, or GLIBC_TUNABLES already sets a
glibc.malloc tunable (the user's setting wins). Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_UP_TO = 2 ** 31 - 1  # bytes of free heap top kept, the largest an int parameter allows


def keep_freed_memory() -> bool:
    """Turn off mmap'd chunks and heap trimming for this process; True if glibc took both."""
    if os.environ.get("DGR2_MALLOC", "").lower() == "system":
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_UP_TO) == 1
    log.debug("glibc malloc: mmap'd chunks off, heap trimming off: %s", ok)
    return ok
