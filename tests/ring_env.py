"""What the SPSC and MPSC ring tests share: guarded ring environments, a queue model, payloads."""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import mmap
from collections import deque

from hypothesis import event, strategies as st

from cxlrpc.memory import RELEASE, AtomicMemory
from cxlrpc.ring import ring_size
from cxlrpc.ring.record import HEAD_OFFSET, TAIL_OFFSET

GUARD = 256  # guard bytes before and after the ring (the ring sits at offset GUARD)
GUARD_BYTE = 0xA5
CAPACITIES = [1024, 2048, 4096, 8192]


# ----------------------------------------------------------------------------- helpers
def payload(uid: int, n: int) -> bytes:
    """Deterministic, record-unique bytes (so a swapped/duplicated/corrupted record shows)."""
    pat = hashlib.blake2b(uid.to_bytes(8, "little"), digest_size=32).digest()
    return (pat * (n // 32 + 1))[:n]


def rec_size(n: int) -> int:
    return 8 + ((n + 7) & ~7)


class Env:
    """A ring of class ``ring_cls`` over an anonymous mmap, with guard bytes on both sides of it."""

    def __init__(self, ring_cls: type, cap: int, start: int = 0) -> None:
        self.cap = cap
        self.mm = mmap.mmap(-1, GUARD + ring_size(cap) + GUARD)
        self.mm[:] = bytes([GUARD_BYTE]) * len(self.mm)
        self.buf = memoryview(self.mm)
        self.mem = AtomicMemory(self.mm)
        self.ring = ring_cls(self.buf, self.mem, GUARD, cap)
        self.ring.reset()
        if start:  # both counters at an arbitrary aligned position: wrap points shift
            self.store_counter(TAIL_OFFSET, start)
            self.store_counter(HEAD_OFFSET, start)
            self.ring.attach()
        self.data = self.ring.data  # absolute offset of the data area in the mmap
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.base_addr = ctypes.addressof(anchor)
        del anchor

    def guards_intact(self) -> bool:
        pat = bytes([GUARD_BYTE]) * GUARD
        return self.buf[:GUARD] == pat and self.buf[len(self.mm) - GUARD:] == pat

    def view_in_bounds(self, view: memoryview) -> bool:
        """The view lies inside the ring's data area (by address, and by length)."""
        n = len(view)
        if n > self.ring.max_payload or n > self.cap:
            return False
        if n == 0:
            return True
        anchor = ctypes.c_char.from_buffer(view)
        off = ctypes.addressof(anchor) - self.base_addr
        del anchor
        return self.data <= off and off + n <= self.data + self.cap

    def store_counter(self, which: int, value: int) -> None:
        self.mem.store(GUARD + which, value, RELEASE)

    def load_counter(self, which: int) -> int:
        return self.mem.load(GUARD + which, 0)


class Model:
    """What the ring must hold: records with the tail position after each, and counters."""

    def __init__(self, cap: int, start: int = 0) -> None:
        self.cap = cap
        self.q: deque[tuple[bytes, int]] = deque()
        self.head = self.tail = start
        self.uid = itertools.count(1)

    def place(self, tail: int, n: int) -> int:
        """Tail after appending an n-byte record at ``tail`` (wrap padding included)."""
        size = rec_size(n)
        to_end = self.cap - tail % self.cap
        return tail + (size if size <= to_end else to_end + size)

    def fits(self, tail: int, n: int) -> bool:
        ok = self.place(tail, n) - self.head <= self.cap
        if not ok:
            event("ring full")
        return ok

    def push(self, data: bytes) -> None:
        new = self.place(self.tail, len(data))
        if new - self.tail != rec_size(len(data)):
            event("wrap padding")
        self.tail = new
        self.q.append((data, self.tail))

    def pop(self) -> bytes | None:
        if not self.q:
            return None
        data, end = self.q.popleft()
        self.head = end
        return data


def sizes(maxp: int):
    return st.one_of(
        st.integers(0, 24),
        st.integers(0, maxp),
        st.sampled_from([maxp, maxp - 1, maxp - 7, maxp - 8, maxp // 2]),
    )
