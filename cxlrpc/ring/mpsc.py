"""Many-producer single-consumer ring (Agrona ManyToOneRingBuffer style).

A producer claims space with a CAS on the tail, writes an uncommitted header carrying its
producer id, copies the payload, then release-stores the committed header.  The consumer
stops at an uncommitted record and zeroes what it consumes, so every header a producer
has not yet written reads as zero.  A record whose producer died between claim and commit
is turned into padding by :meth:`MpscRing.unblock` once the caller knows the producer is
dead, so one crash never stalls the ring.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..memory import ACQ_REL, ACQUIRE, RELAXED, RELEASE
from .base import COUNTER_LIMIT, RingBase
from .record import (
    COMMITTED,
    HEADER_SIZE,
    KIND_DATA,
    KIND_PADDING,
    LENGTH_MASK,
    MAX_PRODUCER_ID,
    header_producer,
)


class MpscRing(RingBase):
    """Many producers (each with an id below 65536), one consumer."""

    _multi_producer = True

    def try_push(self, data: bytes | memoryview, producer: int = 0) -> bool:
        """Append one record; False when the ring is full (backpressure, nothing written)."""
        return self.try_push_parts((data,), producer)

    def try_push_parts(self, parts: Sequence[bytes | memoryview], producer: int = 0) -> bool:
        """Claim, fill and commit one record made of ``parts`` concatenated."""
        if not 0 <= producer <= MAX_PRODUCER_ID:
            raise ValueError("producer id must fit in 16 bits")
        length = 0
        for p in parts:
            length += len(p)
        if length > self.max_payload:
            raise ValueError(f"record of {length} bytes exceeds the ring's limit {self.max_payload}")
        cap, mask = self.capacity, self.mask
        size = HEADER_SIZE + ((length + 7) & ~7)
        tail_ctr = self._tail
        while True:
            tail = tail_ctr.load(ACQUIRE)
            if tail & 7 or tail >= COUNTER_LIMIT:
                return False  # garbage tail: the consumer resets it
            idx = tail & mask
            to_end = cap - idx
            need = size if size <= to_end else to_end + size
            if tail + need - self._head_cache > cap or self._head_cache > tail:
                head = self._head.load(ACQUIRE)
                if not self.valid_head(head, tail):
                    return False  # garbage head: the consumer republishes its own
                self._head_cache = head
                if tail + need - head > cap:
                    return False
            if tail_ctr.cas(tail, tail + need, ACQ_REL) == tail:
                break
        store, data = self.mem.store, self.data
        tag = (producer << 32) | length
        if need != size:
            # Our record goes to the start: the uncommitted header goes first, so the
            # whole claim is attributable to us before the padding makes it reachable.
            store(data, (KIND_DATA << 48) | tag, RELEASE)
            store(data + idx, COMMITTED | (KIND_PADDING << 48) | (producer << 32) | (to_end - HEADER_SIZE), RELEASE)
            idx = 0
        else:
            store(data + idx, (KIND_DATA << 48) | tag, RELEASE)
        start = data + idx + HEADER_SIZE
        buf = self.buf
        for p in parts:
            n = len(p)
            buf[start:start + n] = p
            start += n
        store(data + idx, COMMITTED | (KIND_DATA << 48) | tag, RELEASE)
        return True

    def blocked_producer(self) -> int | None:
        """The producer id of the uncommitted record at the head, -1 if its header is not
        written yet, or None when the head is not blocked (empty, or committed)."""
        head = self._head_local
        tail = self._tail.load(ACQUIRE)
        if tail == head or tail < head or tail - head > self.capacity:
            return None
        word = self.mem.load(self.data + (head & self.mask), ACQUIRE)
        if word & COMMITTED:
            return None
        return header_producer(word) if word else -1

    def unblock(self, producer_dead: Callable[[int], bool], force: bool = False) -> bool:
        """Consumer only: turn a dead producer's uncommitted record at the head into padding.

        ``producer_dead(id)`` tells whether the producer that wrote the header is gone.  A
        header still zero (the producer died between its claim and its first store) is only
        cleared with ``force=True``, which the caller passes after the head has been stuck
        for longer than any live producer takes; the gap then extends to the next written
        header (or the tail, or the end of the buffer).  Returns True if it unblocked.
        """
        head = self._head_local
        tail = self._tail.load(ACQUIRE)
        if tail <= head or tail - head > self.capacity or tail & 7:
            return False
        idx = head & self.mask
        word = self.mem.load(self.data + idx, ACQUIRE)
        if word & COMMITTED:
            return False
        to_end = self.capacity - idx
        if word:
            if not producer_dead(header_producer(word)):
                return False
            size = HEADER_SIZE + (((word & LENGTH_MASK) + 7) & ~7)
            if size > to_end or head + size > tail:
                size = min(to_end, tail - head)
        elif force:
            limit = min(to_end, tail - head)
            size = HEADER_SIZE
            load = self.mem.load
            while size < limit and load(self.data + idx + size, RELAXED) == 0:
                size += HEADER_SIZE
        else:
            return False
        self.mem.store(self.data + idx, COMMITTED | (KIND_PADDING << 48) | (size - HEADER_SIZE), RELEASE)
        self.dropped += 1
        return True
