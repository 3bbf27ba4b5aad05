"""glibc malloc settings that keep big message bodies from page-faulting.

A body copied out of shared memory lands in a fresh ``bytes`` object. glibc gives freed heap
back to the kernel once the free top of the heap passes its trim threshold, which by default
follows the largest freed chunk (twice it, up to 64 MiB); a client whose live big replies come
and go (a 1 MiB echo, a 1 MiB request to a sink, a 1 MiB reply in turn) then touches every fresh
reply in anew, one 4 KiB page fault at a time: 480 faults per three such calls here, the three
taking 1.13 ms instead of 0.57. ``keep_freed_heap`` fixes both thresholds once per process
(glibc only), unless the user chose malloc settings of their own or ``CXLRPC_KEEP_HEAP=0``.
"""
from __future__ import annotations

import ctypes
import os
import platform

#: mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Allocations up to this size come from the heap, not a fresh mmap (glibc's own ceiling for
#: its moving threshold: the largest it accepts).
MMAP_THRESHOLD = 32 << 20
#: Freed heap at the top kept mapped, up to this much: four bodies of MMAP_THRESHOLD.
TRIM_THRESHOLD = 128 << 20
#: Environment settings by which a user already chose glibc's malloc thresholds.
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied: bool | None = None


def keep_freed_heap() -> bool:
    """Set glibc's mmap and trim thresholds (once per process; later calls return the first
    answer): whether they were set. Left alone off glibc, where ``CXLRPC_KEEP_HEAP=0``, and
    where the environment already sets malloc thresholds (``MALLOC_*_`` or malloc
    ``GLIBC_TUNABLES``)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("CXLRPC_KEEP_HEAP", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either ends glibc's moving thresholds
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
