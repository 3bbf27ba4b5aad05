"""A poller that finds its CPU shared with another runnable task moves off it.

On a machine with few cores the kernel often puts a woken consumer on its waker's CPU (a
socket wake-up is a "sync" one: the waker is expected to sleep soon, and ours polls on). Two
pollers then take turns on one CPU while another CPU idles: a 64 B round trip takes ~45 us
instead of ~3 (2 cores here), until the load balancer separates them, which it is slow to do
for tasks that ran microseconds ago ("cache hot"). A ``sched_yield`` that returns late shows
another runnable task on this CPU; after enough of them in a row the polling thread moves off
the CPU: its affinity narrowed to the other CPUs it may use for one system call (the kernel
moves it to the idlest), then given back whole. It stays where it landed. A doorbell wake-up
names the CPU it was sent from: woken on that CPU, a thread needs only one late yield more.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Callable

#: A yield that took this long ran another task of this CPU (alone: ~0.7 us here).
SHARED_YIELD_S = 2.5e-6
#: Late yields in a row before a move (a VM's stolen time makes single ones).
EVIDENCE = 16
#: At most one move per this long, per thread (three pollers on two CPUs share one anyway).
MOVE_EVERY_S = 0.1


def _sched_getcpu() -> Callable[[], int] | None:
    """libc's sched_getcpu, or None where it is missing."""
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
        getcpu.restype = ctypes.c_int
        getcpu.argtypes = ()
    except (OSError, AttributeError):  # not glibc/musl with sched_getcpu: never move
        return None
    return getcpu  # (its restype: an int)


_getcpu = _sched_getcpu()


def this_cpu() -> int:
    """The CPU the calling thread runs on (-1 where sched_getcpu is missing)."""
    return _getcpu() if _getcpu is not None else -1


def move_off_this_cpu() -> int | None:
    """Move the calling thread to another CPU of its affinity mask (the mask itself left as
    it was); the CPU it left, or None when it has nowhere to go."""
    if _getcpu is None:
        return None
    allowed = os.sched_getaffinity(0)
    cpu = _getcpu()
    if cpu not in allowed or len(allowed) < 2:
        return None
    try:
        os.sched_setaffinity(0, allowed - {cpu})  # the kernel moves us at once, to the idlest
    except OSError:  # (those CPUs went offline, a cpuset changed meanwhile): stay
        return None
    os.sched_setaffinity(0, allowed)
    return cpu


class SharedCpu:
    """Evidence that a polling thread's CPU runs another task too: yield by yield, or a
    wake-up sent from this very CPU and one late yield after it."""

    __slots__ = ("late", "moved_at", "moves")

    def __init__(self) -> None:
        self.late = 0  # late yields in a row
        self.moved_at = -MOVE_EVERY_S
        self.moves = 0

    def yield_cpu(self) -> None:
        """``sched_yield``, timed: after EVIDENCE late ones in a row, move off this CPU."""
        start = time.perf_counter()
        os.sched_yield()
        end = time.perf_counter()
        if end - start < SHARED_YIELD_S:
            self.late = 0
            return
        self.late += 1
        if self.late >= EVIDENCE and end - self.moved_at >= MOVE_EVERY_S:
            self.late = 0
            self.moved_at = end
            if move_off_this_cpu() is not None:
                self.moves += 1

    def woken_from(self, cpu: int) -> None:
        """A doorbell wake-up was sent from ``cpu``. If that is this thread's CPU, the kernel
        put the woken thread beside its waker (a socket wake-up is a "sync" one), where both
        would poll by turns, each round trip ~25-50 us: the next late yield alone moves it,
        with no rate limit (an idle period came between). Not a move at once: that takes
        ~0.1 ms here, which the call that woke it would wait for, even when no other follows."""
        if cpu >= 0 and cpu == this_cpu():
            self.late = EVIDENCE - 1
            self.moved_at = -MOVE_EVERY_S
