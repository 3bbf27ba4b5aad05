"""Every cross-process atomic access goes through this module.

Shared counters are 8-byte aligned u64 words updated with real atomic instructions
(``atomicshm``, ~30 ns per op) with explicit memory orderings.  Code in higher layers
binds a :class:`Counter` once per field and calls ``load``/``store``/``cas``/``fetch_add``
on it; it never packs a published field with ``struct``.

Only hardware-coherent memory is supported (POSIX shm, coherent CXL.mem); a
flush/invalidate hook for non-coherent pools would live here.
"""
from __future__ import annotations

import ctypes

import atomicshm

RELAXED: int = atomicshm.RELAXED
ACQUIRE: int = atomicshm.ACQUIRE
RELEASE: int = atomicshm.RELEASE
ACQ_REL: int = atomicshm.ACQ_REL
SEQ_CST: int = atomicshm.SEQ_CST

#: An atomic 64-bit cell bound to one offset: ``load(order)``, ``store(v, order)``,
#: ``cas(expected, desired, order)`` (returns the previous value), ``fetch_add(n, order)``,
#: ``exchange(v, order)``.
Counter = atomicshm.AtomicU64

class AtomicMemory:
    """Atomic access to a writable buffer (a region's mapping, or any bytearray/mmap).

    ``load(off, order)``, ``store(off, value, order)``, ``cas(off, expected, desired, order)``
    (returns the previous value) and ``fetch_add(off, delta, order)`` act on the aligned u64
    at ``off``; they are the extension's bound methods, so a call costs no Python frame.
    """

    __slots__ = ("_view", "size", "load", "store", "cas", "fetch_add", "exchange")

    def __init__(self, buffer) -> None:
        view = atomicshm.AtomicView(buffer)
        self._view = view
        self.size: int = view.nbytes
        self.load = view.load_u64
        self.store = view.store_u64
        self.cas = view.cas_u64
        self.fetch_add = view.fetch_add_u64
        self.exchange = view.exchange_u64

    def zero(self, offset: int, length: int) -> None:
        """memset ``length`` bytes at ``offset`` to zero (no source buffer to read, unlike a copy)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"zero({offset}, {length}) outside a {self.size}-byte buffer")
        ctypes.memset(self._view.address + offset, 0, length)

    def counter(self, offset: int) -> Counter:
        """Bind an atomic u64 at ``offset`` (bounds and 8-byte alignment checked here, once)."""
        return self._view.cell_u64(offset)

    def close(self) -> None:
        """Release the buffer export so the mapping can be closed."""
        self._view.close()

    def __enter__(self) -> "AtomicMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fence(order: int = SEQ_CST) -> None:
    """A full (by default) memory fence: orders this thread's loads and stores."""
    atomicshm.fence(order)

