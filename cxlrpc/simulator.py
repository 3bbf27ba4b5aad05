"""A region backend that behaves like memory without cross-host cache coherence (``sim://NAME``).

Each process that maps a simulated region works on its own private copy (its "cache") of a
shared segment (the "memory"). Loads and stores, atomic ones included, touch only the cache:
another process sees a line only after its writer wrote it back (``writeback``, or a random
eviction), and a reader sees new memory contents only after it invalidated its copy
(``invalidate``, or a random eviction of a clean line). Lines move whole, 64 bytes at a time,
as real caches move them: two processes writing one line lose each other's updates. Random
evictions make partial writes visible in any order. Atomic read-modify-writes are atomic only
within one process, as on a non-coherent CXL pool they are only within one host.

It exists for tests: code that forgets one write-back or one invalidate fails under it.
"""
from __future__ import annotations

import mmap
import random

LINE = 64
#: Chance that a write-back or invalidate call also evicts one random line (tests may lower it
#: to 0 to make a missing flush fail deterministically instead of merely slowly).
EVICTION_RATE = 0.05


class CacheSim:
    """One process's cache over a shared ``memory`` mapping (the same size, page-rounded)."""

    def __init__(self, memory: mmap.mmap, eviction_rate: float | None = None,
                 seed: int | None = None) -> None:
        size = len(memory)
        if size % LINE:
            raise ValueError("simulated regions are whole lines")
        import numpy as np  # here, not at import: numpy's BLAS threads spin in every process that loads it

        self.memory = memory
        self.cache = _anonymous(size)
        self._clean_map = _anonymous(size)  # what the cache last agreed with memory on, per line
        # 8-byte elements: a line moves as whole aligned words, so another process never sees
        # a torn word (real caches move whole lines; the rings rely on atomic 8-byte words)
        self._mem = np.frombuffer(memory, dtype=np.uint64).reshape(-1, LINE // 8)
        self._cache = np.frombuffer(self.cache, dtype=np.uint64).reshape(-1, LINE // 8)
        self._clean = np.frombuffer(self._clean_map, dtype=np.uint64).reshape(-1, LINE // 8)
        self._clean[:] = self._mem
        self._cache[:] = self._clean  # a cold cache: everything fetched from memory now
        self._rate = EVICTION_RATE if eviction_rate is None else eviction_rate
        self._rng = random.Random(seed)
        self.writebacks = self.invalidates = self.evictions = 0

    def _lines(self, offset: int, length: int) -> slice:
        return slice(offset // LINE, -(-(offset + length) // LINE))

    def _write_dirty(self, lines: slice) -> None:
        cache, clean = self._cache[lines], self._clean[lines]
        dirty = (cache != clean).any(axis=1)
        if dirty.any():
            self._mem[lines][dirty] = cache[dirty]
            clean[dirty] = cache[dirty]

    def writeback(self, offset: int, length: int) -> None:
        """Write the range's dirty lines back to memory (whole lines)."""
        self.writebacks += 1
        self._write_dirty(self._lines(offset, length))
        self._evict_some()

    def invalidate(self, offset: int, length: int) -> None:
        """Write back the range's dirty lines (as clflushopt does), then refetch every line."""
        self.invalidates += 1
        lines = self._lines(offset, length)
        self._write_dirty(lines)
        self._refetch(lines)
        self._evict_some()

    def _refetch(self, lines: slice) -> None:
        """Load lines from memory: one read of memory, so cache and clean copy agree even
        while another process writes those lines back."""
        self._cache[lines] = self._mem[lines]
        self._clean[lines] = self._cache[lines]

    def _evict_some(self) -> None:
        """Now and then a random line leaves the cache: written back if dirty, refetched."""
        if self._rng.random() >= self._rate:
            return
        self.evictions += 1
        line = self._rng.randrange(len(self._mem))
        one = slice(line, line + 1)
        self._write_dirty(one)
        self._refetch(one)

    def close(self) -> None:
        del self._mem, self._cache, self._clean
        self.cache.close()
        self._clean_map.close()
        self.memory.close()


def _anonymous(size: int) -> mmap.mmap:
    """Private memory for a cache copy, on huge pages where the kernel allows (a simulated
    region of 100+ MiB then maps in a fraction of the time 4 KiB faults take)."""
    area = mmap.mmap(-1, size)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return area
