"""Single-producer single-consumer ring (Lamport/Disruptor style).

The producer owns the tail, the consumer owns the head; each keeps a private copy of its
own counter and a cached copy of the other's, so the common case touches one shared line.
Records become visible with one release-store of the tail, so a batch costs one publish.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from ..memory import ACQUIRE, RELAXED, RELEASE, AtomicMemory, BytesLike
from .base import _native, RingBase, adoptable, sane
from .record import COMMITTED, HEADER_SIZE, KIND_DATA, KIND_PADDING, PAD_CLEAN


class SpscRing(RingBase):
    """One producer, one consumer, variable-length records, wrap-around by padding."""

    def __init__(self, buf: memoryview, mem: AtomicMemory, offset: int, capacity: int) -> None:
        super().__init__(buf, mem, offset, capacity)
        self._tail_local = adoptable(self._tail.load(RELAXED))

    def reset(self) -> None:
        super().reset()
        self._tail_local = 0

    def attach(self) -> None:
        super().attach()
        self.mem.invalidate(self._tail_at, 8)
        self._tail_local = adoptable(self._tail.load(ACQUIRE))

    def skip_to_tail(self) -> None:
        """Consumer only: discard everything published so far (a new holder of the ring)."""
        self.mem.invalidate(self._tail_at, 8)
        tail = self._tail.load(ACQUIRE)
        if not sane(tail):
            tail = adoptable(self._head.load(ACQUIRE))  # garbage tail: the producer republishes its own
        self._head_local = tail
        self._store_head(tail)

    def _store_tail(self, tail: int) -> None:
        """Publish the producer's tail (off the hot path: repairs)."""
        self._tail.store(tail, RELEASE)
        self.mem.writeback(self._tail_at, 8)

    def _reserve(self, tail: int, length: int) -> int:
        """Write any wrap padding and the header for a ``length`` record at ``tail``.

        Returns the new local tail after the record, or -1 when the ring lacks room.
        """
        cap = self.capacity
        if length > self.max_payload:
            raise ValueError(f"record of {length} bytes exceeds the ring's limit {self.max_payload}")
        size = HEADER_SIZE + ((length + 7) & ~7)
        idx = tail & self.mask
        to_end = cap - idx
        need = size if size <= to_end and not self._early_wrap(tail, idx, size) else to_end + size
        if self._head_cache > tail or tail + need - self._head_cache > cap:
            if self._flushing:
                self.mem.invalidate(self._head_at, 8)
            head = self._head.load(ACQUIRE)
            if not self.valid_head(head, tail):
                if not head & 7 and tail < head <= tail + cap and tail == self._tail_local:
                    # The consumer ran past our tail over garbage: resume where it stands.
                    self._tail_local = self._head_cache = head
                self._store_tail(self._tail_local)  # repair a garbage tail
                return -1
            self._head_cache = head
            if tail + need - head > cap:
                # republish what we published (repairs garbage over it), never the running
                # tail of a batch whose records are not written back yet
                self._store_tail(self._tail_local)
                return -1
        store = self.mem.store
        if need != size:
            store(self.data + idx, COMMITTED | PAD_CLEAN | (KIND_PADDING << 48) | (to_end - HEADER_SIZE), RELAXED)
            idx = 0
        store(self.data + idx, COMMITTED | (KIND_DATA << 48) | length, RELAXED)
        return tail + need

    def try_push(self, data: bytes | memoryview) -> bool:
        """Append one record; False when the ring is full (backpressure, nothing written)."""
        return self.try_push_parts((data,))

    def _try_push_parts_py(self, parts: Sequence[BytesLike]) -> bool:
        """Append one record made of ``parts`` concatenated (saves the caller a join copy)."""
        length = 0
        for p in parts:
            length += len(p)
        tail = self._tail_local
        new_tail = self._reserve(tail, length)
        if new_tail < 0:
            return False
        start = self.data + ((new_tail - HEADER_SIZE - ((length + 7) & ~7)) & self.mask) + HEADER_SIZE
        buf = self.buf
        for p in parts:
            n = len(p)
            buf[start:start + n] = p
            start += n
        if self._flushing:
            self._span(self.mem.writeback, tail, new_tail)
        self._tail_local = new_tail
        self._tail.store(new_tail, RELEASE)
        if self._flushing:
            self.mem.writeback(self._tail_at, 8)
        return True

    #: ``try_push_parts(parts)``: the native twin of the method above where it is built.
    try_push_parts = _native.RingCore._push_spsc if _native is not None else _try_push_parts_py

    def try_push_batch(self, records: Iterable[bytes | memoryview]) -> int:
        """Append records in order until one does not fit; one publish for all. Returns how many."""
        tail = self._tail_local
        count = 0
        buf = self.buf
        for rec in records:
            length = len(rec)
            new_tail = self._reserve(tail, length)
            if new_tail < 0:
                break
            start = self.data + ((new_tail - HEADER_SIZE - ((length + 7) & ~7)) & self.mask) + HEADER_SIZE
            buf[start:start + length] = rec
            tail = new_tail
            count += 1
        if count:
            if self._flushing:
                self._span(self.mem.writeback, self._tail_local, tail)
            self._tail_local = tail
            self._tail.store(tail, RELEASE)
            if self._flushing:
                self.mem.writeback(self._tail_at, 8)
        return count
