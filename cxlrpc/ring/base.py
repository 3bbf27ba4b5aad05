"""What both rings share: layout binding and the validating consumer."""
from __future__ import annotations

from typing import Callable

from ..memory import ACQUIRE, RELAXED, RELEASE, AtomicMemory
from .record import (
    COMMITTED,
    CONTROL_SIZE,
    HEAD_OFFSET,
    HEADER_SIZE,
    KIND_DATA,
    KIND_PADDING,
    LENGTH_MASK,
    TAIL_OFFSET,
    ZEROS,
    check_capacity,
    max_payload,
)


class RingBase:
    """A ring laid out at ``offset`` in ``buf``: control block, then ``capacity`` data bytes.

    The consumer side lives here; subclasses add their producer protocol.  Every header
    and counter read from the buffer is validated: a corrupt record is skipped together
    with everything up to the tail, and counted in :attr:`dropped`.
    """

    #: MPSC consumers zero what they consume (producers' headers start out as zero);
    #: SPSC consumers need not, since the tail alone publishes.
    _zero_consumed = False

    def __init__(self, buf: memoryview, mem: AtomicMemory, offset: int, capacity: int) -> None:
        check_capacity(capacity)
        if offset % 128 or offset < 0 or offset + CONTROL_SIZE + capacity > len(buf):
            raise ValueError("ring does not fit its buffer at that offset (or is misaligned)")
        self.buf = buf
        self.mem = mem
        self.capacity = capacity
        self.mask = capacity - 1
        self.max_payload = max_payload(capacity)
        self.data = offset + CONTROL_SIZE
        self._tail = mem.counter(offset + TAIL_OFFSET)
        self._head = mem.counter(offset + HEAD_OFFSET)
        self._head_cache = 0  # producer's last-seen head
        self.dropped = 0  # records or bytes the consumer discarded as corrupt

    def reset(self) -> None:
        """Zero counters and data: only while no peer uses the ring (creation, reclamation)."""
        self.buf[self.data:self.data + self.capacity] = ZEROS.get(self.capacity)
        self._tail.store(0, RELEASE)
        self._head.store(0, RELEASE)
        self._head_cache = 0

    # ------------------------------------------------------------------ consumer
    def readable(self) -> bool:
        """True when the tail is ahead of the head (records claimed, maybe not yet committed)."""
        return self._tail.load(ACQUIRE) != self._head.load(RELAXED)

    def poll(self, handler: Callable[[memoryview], object], limit: int = 1 << 30) -> int:
        """Hand up to ``limit`` committed payloads to ``handler`` in order, then free their space.

        The memoryview passed to ``handler`` is only valid during the call: decode or copy it.
        Returns the number of payloads handled.
        """
        head = self._head.load(RELAXED)
        tail = self._tail.load(ACQUIRE)
        if tail == head:
            return 0
        cap = self.capacity
        if tail - head > cap or tail < head:
            return self._resync(head, tail)
        mask, data, load = self.mask, self.data, self.mem.load
        buf = self.buf
        pos = head
        count = 0
        while pos < tail and count < limit:
            idx = pos & mask
            word = load(data + idx, ACQUIRE)
            if not word & COMMITTED:
                break
            length = word & LENGTH_MASK
            size = HEADER_SIZE + ((length + 7) & ~7)
            kind = (word >> 48) & 0xFF
            if size > cap - idx or pos + size > tail or (kind != KIND_DATA and kind != KIND_PADDING):
                self._release(head, pos)
                return count + self._resync(pos, tail)
            if kind == KIND_DATA:
                start = data + idx + HEADER_SIZE
                handler(buf[start:start + length])
                count += 1
            pos += size
        if pos != head:
            self._release(head, pos)
        return count

    def pop(self) -> bytes | None:
        """Copy out and free the next committed payload, or None when there is none."""
        out: list[bytes] = []
        self.poll(lambda view: out.append(bytes(view)), 1)
        return out[0] if out else None

    def pop_batch(self, limit: int = 1 << 30) -> list[bytes]:
        """Copy out and free up to ``limit`` committed payloads."""
        out: list[bytes] = []
        self.poll(lambda view: out.append(bytes(view)), limit)
        return out

    def _release(self, head: int, pos: int) -> None:
        if pos == head:
            return
        if self._zero_consumed:
            self._zero(head, pos)
        self._head.store(pos, RELEASE)

    def _zero(self, start: int, end: int) -> None:
        cap, buf, data = self.capacity, self.buf, self.data
        while start < end:
            idx = start & self.mask
            n = min(end - start, cap - idx)
            buf[data + idx:data + idx + n] = ZEROS.get(n)
            start += n

    def _resync(self, head: int, tail: int) -> int:
        """Corrupt state: discard everything from ``head`` to the tail and count it.

        A tail behind the head or more than a lap ahead is itself garbage: the head jumps to
        it (after clearing the data, for MPSC) so producers and consumer agree again.
        """
        self.dropped += 1
        if tail < head or tail - head > self.capacity:
            if self._zero_consumed:
                self.buf[self.data:self.data + self.capacity] = ZEROS.get(self.capacity)
            self._head.store(tail, RELEASE)
        else:
            self._release(head, tail)
        return 0

    def free_space(self) -> int:
        """Bytes a producer could claim now (a snapshot)."""
        used = self._tail.load(ACQUIRE) - self._head.load(ACQUIRE)
        return self.capacity - min(max(used, 0), self.capacity)
