"""Words one owner writes and others only read, kept true by the owner's housekeeping.

A server writes its region's header (owner state, PID, identity, layout words) and its
control block (state, geometry and their checksum) once; every client trusts them.  A stray
8-byte write over one of them (a buggy or hostile peer, a bad DMA) would otherwise stay there
for the server's lifetime: ``OwnedWords`` remembers what the owner wrote and
``OwnedWords.restore`` puts back any word that differs.  The owner calls it from its
housekeeping (about ten times a second), never on the hot path.

On memory without coherence the lines are invalidated first (a stray write from another host
is in memory, not in the owner's cache) and written back only when a word was restored; lines
move whole, so the other words of a restored line are rewritten with what memory held.
"""
from __future__ import annotations

from typing import Iterable

from .memory import ACQUIRE, RELEASE, AtomicMemory

LINE = 64


class OwnedWords:
    """The expected values of single-writer words at offsets of one memory (8-byte aligned)."""

    __slots__ = ("_mem", "_words")

    def __init__(self, mem: AtomicMemory, words: Iterable[tuple[int, int]] = ()) -> None:
        self._mem = mem
        self._words: dict[int, int] = {}
        for offset, value in words:
            self.expect(offset, value)

    def expect(self, offset: int, value: int) -> None:
        """From now on the word at ``offset`` should hold ``value`` (the owner just wrote it)."""
        if offset % 8 or not 0 <= offset <= self._mem.size - 8:
            raise ValueError(f"owned word at {offset} is not an aligned word of the memory")
        self._words[offset] = value

    def restore(self) -> int:
        """Put back every word that no longer holds what the owner wrote; how many were wrong."""
        mem = self._mem
        lines = sorted({offset // LINE for offset in self._words})
        if mem.flushing:
            for line in lines:
                mem.invalidate(line * LINE, LINE)
        restored = 0
        dirty = set()
        for offset, value in self._words.items():
            if mem.load(offset, ACQUIRE) != value:
                mem.store(offset, value, RELEASE)
                restored += 1
                dirty.add(offset // LINE)
        if mem.flushing:
            for line in sorted(dirty):
                mem.writeback(line * LINE, LINE)
        return restored
