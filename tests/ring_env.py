"""What the SPSC and MPSC ring tests share: guarded ring environments, a queue model, payloads."""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import mmap
import random
import struct
import zlib
from collections import deque

from hypothesis import event, strategies as st

from cxlrpc.memory import RELEASE, AtomicMemory
from cxlrpc.ring import ring_size
from cxlrpc.ring.record import HEAD_OFFSET, KIND_DATA, KIND_PADDING, TAIL_OFFSET, hot_span, make_header

TAG = struct.Struct("<HII")  # producer id, sequence number, crc32 of the rest

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
    """What the ring must hold: records with the tail position after each, and counters.
    ``early``: the producer wraps early (cxlrpc.ring.record), as the rings' own producers do."""

    def __init__(self, cap: int, start: int = 0, early: bool = True) -> None:
        self.cap = cap
        self.q: deque[tuple[bytes, int]] = deque()
        self.head = self.tail = start
        self.uid = itertools.count(1)
        self.early, self.span, self.wrap_from = early, hot_span(cap), 0
        self._placed: dict[tuple[int, int], int] = {}  # decided since the head last moved

    def place(self, tail: int, n: int) -> int:
        """Tail after appending an n-byte record at ``tail`` (wrap padding included). Decided
        once until the head moves, as the producer's own attempt decides it (an early wrap's
        look at the head moves its next look on)."""
        if (tail, n) not in self._placed:
            size = rec_size(n)
            idx = tail % self.cap
            to_end = self.cap - idx
            early = size <= to_end and self._wraps_early(tail, idx, size)
            self._placed[tail, n] = tail + (size if size <= to_end and not early else to_end + size)
        return self._placed[tail, n]

    def _wraps_early(self, tail: int, idx: int, size: int) -> bool:
        if (not self.early or idx < self.span or size > idx
                or (tail < self.wrap_from and self.wrap_from - tail <= self.span)):
            return False
        if self.head == tail:
            event("early wrap")
            return True
        self.wrap_from = tail + self.span
        return False

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
        self._placed.clear()
        return data


def sizes(maxp: int):
    return st.one_of(
        st.integers(0, 24),
        st.integers(0, maxp),
        st.sampled_from([maxp, maxp - 1, maxp - 7, maxp - 8, maxp // 2]),
    )


def make_record(rng: random.Random, pid: int, seq: int, maxp: int) -> bytes:
    n = rng.choice([0, rng.randrange(0, 64), rng.randrange(0, maxp - TAG.size + 1)])
    body = rng.randbytes(n)
    return TAG.pack(pid, seq, zlib.crc32(body)) + body


def header_words(cap: int):
    """Plausible-looking header words (valid or subtly invalid fields)."""
    return st.builds(
        make_header,
        st.one_of(st.integers(0, cap), st.integers(0, 0xFFFFFFFF)),
        st.sampled_from([KIND_DATA, KIND_PADDING, 0, 3, 0xFF]),
        st.integers(0, 0xFFFF),
        st.booleans(),
    )


@st.composite
def data_garbage(draw, cap: int):
    """Garbage for the data area: an optional full random fill, then word overwrites."""
    fill = draw(st.one_of(st.none(), st.integers(0, 2**32)))
    words = draw(st.lists(
        st.tuples(st.integers(0, cap // 8 - 1).map(lambda i: i * 8),
                  st.one_of(header_words(cap), st.integers(0, 2**64 - 1))),
        max_size=8,
    ))
    return fill, words


def apply_data_garbage(env: Env, garbage, near_head: bool = False) -> None:
    """Write the garbage; with ``near_head`` the word offsets count from the head's slot."""
    fill, words = garbage
    if fill is not None:
        env.buf[env.data:env.data + env.cap] = random.Random(fill).randbytes(env.cap)
    base = env.load_counter(HEAD_OFFSET) if near_head else 0
    for off, word in words:
        env.mem.store(env.data + (base + off) % env.cap, word, RELEASE)


def aligned_counter(cap: int):
    """Garbage counter values that are 8-byte aligned and far from overflow."""
    return st.one_of(
        st.integers(-cap // 2, cap // 2).map(lambda d: ("rel", d * 8)),
        st.integers(0, 1 << 59).map(lambda v: ("abs", v * 8)),
    )


def resolve(spec, current: int) -> int:
    kind, v = spec
    return max(current + v, 0) if kind == "rel" else v


def checked_poll(env: Env, seen: list[bytes], limit: int = 1 << 30) -> int:
    def handler(view: memoryview) -> None:
        assert env.view_in_bounds(view), "handler got a view outside the data area"
        seen.append(bytes(view))

    return env.ring.poll(handler, limit)


def far_from(value: int, sign: int, k: int, cap: int) -> int:
    """An aligned value more than a lap (2*cap + 8k bytes) away from ``value``, never negative."""
    d = 2 * cap + 8 * k
    return value - d if sign < 0 and value >= d else value + d
