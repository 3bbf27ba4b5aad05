"""What both rings share: layout binding, counter validation and the validating consumer."""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable, Collection, Protocol

from ..memory import ACQ_REL, ACQUIRE, RELAXED, RELEASE, AtomicMemory
from .record import (
    COMMITTED,
    CONTROL_SIZE,
    HEAD_OFFSET,
    HEADER_SIZE,
    KIND_DATA,
    KIND_PADDING,
    LENGTH_MASK,
    PAD_CLEAN,
    TAIL_OFFSET,
    check_capacity,
    hot_span,
    max_payload,
)

if TYPE_CHECKING:
    from .._flush import Lines
    from .._ring import RingCore


class _Ring(Protocol):
    """``cxlrpc._ring`` as the rings use it (its stub, cxlrpc/_ring.pyi, types RingCore): a
    protocol, so ``_native`` may be None."""

    @property
    def RingCore(self) -> type[RingCore]: ...


_native: _Ring | None
try:
    # CXLRPC_NO_NATIVE=1 runs the Python reference instead (tests, and to rule it out)
    from .. import _ring as _native
except ImportError:  # built by the package where a C compiler exists
    _native = None
if os.environ.get("CXLRPC_NO_NATIVE"):
    _native = None

_SMALL_ZEROS = memoryview(bytes(256))

#: Counters stay far below 2**64 (2**62 bytes is centuries of traffic); larger ones are garbage.
COUNTER_LIMIT = 1 << 62

#: Longest an MPSC consumer waits, at a corrupt record or a garbage tail, for live producers to
#: finish the claims past it before freeing them anyway (a claim word hit by garbage too, or a
#: producer stalled that long mid-copy: its late bytes may then land in a later record).
HOLD_S = 0.5


def sane(counter: int) -> bool:
    """Could a correct peer have published this counter (aligned, below COUNTER_LIMIT)?"""
    return not counter & 7 and counter < COUNTER_LIMIT


def adoptable(counter: int) -> int:
    """A counter read from shared memory, as a private copy may start from it: itself when
    sane, else 0 (garbage; the peers' repairs converge from there)."""
    return counter if sane(counter) else 0


class _PyCore:
    """Where the native module is not built: the state RingBase keeps lives in its __dict__."""

    def __init__(self, buf: memoryview, offset: int, capacity: int, multi_producer: bool,
                 lines: Lines | None = None, flushing: bool = False) -> None:
        pass


#: The native hot path (cxlrpc/_ring.c) keeps the counters' private copies and the dropped
#: count, and runs poll, readable and the pushes: over coherent memory, and for an SPSC ring over
#: memory without coherence too (through the region's ``Lines``, with the write-backs and
#: invalidates of the ``_flushing`` branches here); the ``_py`` methods here are the reference it
#: follows, and run where it is not built, for an MPSC ring without coherence, and where the
#: memory flushes without the native flush module (no ``mem.lines``).
NATIVE = _native is not None
if TYPE_CHECKING:  # the state and methods RingBase has either way (the reference's in Python)
    _Core = RingCore
else:
    _Core = _native.RingCore if _native is not None else _PyCore


class RingBase(_Core):
    """A ring laid out at ``offset`` in ``buf``: control block, then ``capacity`` data bytes.

    The consumer side lives here; subclasses add their producer protocol.  Each side keeps
    a private copy of the counter it owns and only publishes it, so garbage written over a
    shared counter is repaired by the owner's next store.  Every counter and header read
    from the buffer is validated: a corrupt record is skipped together with everything up
    to the tail (MPSC: up to the first claim a live producer is still writing), and counted
    in ``dropped``.
    """

    #: MPSC consumers zero what they consume (producers' headers start out as zero) and wait
    #: at uncommitted headers; in an SPSC ring everything below the tail is complete.
    _multi_producer = False

    #: MPSC consumer: the positions live producers are claiming or writing at (their claim
    #: words, read after the tail), or None when producers publish none. Garbage recovery
    #: never frees space a live producer is still writing.
    live_claims: Callable[[], Collection[int]] | None = None

    def __init__(self, buf: memoryview, mem: AtomicMemory, offset: int, capacity: int) -> None:
        check_capacity(capacity)
        if offset % 128 or offset < 0 or offset + CONTROL_SIZE + capacity > len(buf):
            raise ValueError("ring does not fit its buffer at that offset (or is misaligned)")
        _Core.__init__(self, buf, offset, capacity, self._multi_producer, mem.lines, mem.flushing)
        self.buf = buf
        self.mem = mem
        self.capacity = capacity
        self.mask = capacity - 1
        self.max_payload = max_payload(capacity)
        self._hot_span = hot_span(capacity)
        self._wrap_from = 0  # the tail from which the producer next looks for an early wrap
        self.data = offset + CONTROL_SIZE
        self._tail = mem.counter(offset + TAIL_OFFSET)
        self._head = mem.counter(offset + HEAD_OFFSET)
        self._tail_at, self._head_at = offset + TAIL_OFFSET, offset + HEAD_OFFSET
        #: Memory without coherence: every published line is written back, every line read
        #: from the other side invalidated first (see cxlrpc.memory).  Checked inline, so the
        #: coherent hot path pays one attribute test per site.
        self._flushing = mem.flushing
        self._head_local = self._adopted_head()  # consumer's own copy of its counter
        self._head_cache = self._head_local  # producer's last valid view of the head
        self.dropped = 0  # corrupt records or counters the consumer discarded
        self._holds: dict[str, tuple[int, float]] = {}  # kind -> (position, until): see _waiting
        self._jumped_to: int | None = None  # a claim _past_corrupt stopped at (not a record seen)
        self._garbage_tail = -1  # flush mode: the garbage tail last dropped (counted once)

    def reset(self) -> None:
        """Zero counters and data: only while no peer uses the ring (creation)."""
        self.mem.zero(self.data, self.capacity)
        self._tail.store(0, RELEASE)
        self._head.store(0, RELEASE)
        self.mem.writeback(self._tail_at, self.data + self.capacity - self._tail_at)
        self._head_local = self._head_cache = 0

    def attach(self) -> None:
        """Adopt the ring's published counters (a process taking over an existing ring)."""
        self.mem.invalidate(self._head_at, 8)
        self._head_local = self._head_cache = self._adopted_head()

    def _adopted_head(self) -> int:
        """The head a private copy starts from: the published one, or where the tail stands
        when the head is garbage (what lies between cannot be trusted; a consumer's first
        poll then republishes it)."""
        head = self._head.load(ACQUIRE)
        return head if sane(head) else adoptable(self._tail.load(ACQUIRE))

    def _span(self, op: Callable[[int, int], None], start: int, end: int) -> None:
        """Write back or invalidate the data bytes of positions [start, end) (wrapping)."""
        while start < end:
            idx = start & self.mask
            n = min(end - start, self.capacity - idx)
            op(self.data + idx, n)
            start += n

    def _store_head(self, head: int) -> None:
        """Publish the consumer's head (off the hot path: repairs)."""
        self._head.store(head, RELEASE)
        self.mem.writeback(self._head_at, 8)

    def _early_wrap(self, tail: int, idx: int, size: int) -> bool:
        """Producer: should a record of ``size`` at ``tail`` (``idx`` in the buffer) go to the
        ring's start although it fits before the end? Yes when ``idx`` is the hot span or more
        and the consumer has taken everything (see ``cxlrpc.ring.record``); the head is read
        at most once per hot span of tail."""
        wrap_from = self._wrap_from
        if (self._flushing or idx < self._hot_span or size > idx
                or (tail < wrap_from and wrap_from - tail <= self._hot_span)):
            return False
        head = self._head.load(ACQUIRE)
        if head == tail:
            self._head_cache = head
            return True
        self._wrap_from = tail + self._hot_span
        return False

    def valid_head(self, head: int, tail: int) -> bool:
        """A head a producer may trust: aligned, at most one lap behind ``tail``, not ahead."""
        return not head & 7 and tail - self.capacity <= head <= tail

    # ------------------------------------------------------------------ consumer
    def _readable_py(self) -> bool:
        """True when the tail is ahead of the head (records claimed, maybe not yet committed);
        not for a garbage tail already dropped (flush mode leaves it to its producer: a reader
        woken by it would spin until the producer's next push)."""
        if self._flushing:
            self.mem.invalidate(self._tail_at, 8)
        tail = self._tail.load(ACQUIRE)
        return tail != self._head_local and tail != self._garbage_tail

    #: ``readable()``: the native twin of the method above where it is built.
    readable = _native.RingCore.readable if _native is not None else _readable_py

    def _poll_py(self, handler: Callable[[memoryview], object], limit: int = 1 << 30) -> int:
        """Hand up to ``limit`` committed payloads to ``handler`` in order, then free their space.

        The memoryview passed to ``handler`` is only valid during the call: decode or copy it.
        Returns the number of payloads handled.
        """
        head = self._head_local
        if self._flushing:
            self.mem.invalidate(self._tail_at, 8)
        tail = self._tail.load(ACQUIRE)
        if tail == head:
            if self._head.load(RELAXED) != head:
                self._store_head(head)  # repair garbage written over our counter
            return 0
        cap = self.capacity
        if tail - head > cap or tail < head or tail & 7:
            self._bad_tail(tail)
            return 0
        if self._flushing:
            self._span(self.mem.invalidate, head, tail)
        mask, data, load = self.mask, self.data, self.mem.load
        buf = self.buf
        pos = head
        clean = None  # where a clean padding starts (one per lap at most: it ends the buffer)
        count = 0
        while pos < tail and count < limit:
            idx = pos & mask
            word = load(data + idx, ACQUIRE)
            if not word & COMMITTED and self._multi_producer:
                break  # a producer is still writing this record
            length = word & LENGTH_MASK
            size = HEADER_SIZE + ((length + 7) & ~7)
            kind = (word >> 48) & 0xFF
            if (not word & COMMITTED or size > cap - idx or pos + size > tail
                    or (kind != KIND_DATA and kind != KIND_PADDING)
                    or (kind == KIND_DATA and length > self.max_payload)):  # no producer writes it
                pos = self._past_corrupt(pos, tail)  # nothing up to the tail can be trusted
                break
            if kind == KIND_DATA:
                start = data + idx + HEADER_SIZE
                handler(buf[start:start + length])
                if self._head_local != head:  # a nested poll moved the head under this one
                    raise RuntimeError("a handler polled the ring it was called from")
                count += 1
            else:
                at = pos if word & PAD_CLEAN and idx + size == cap else None
                if pos == head:  # a wrap at the head: freed at once, so producers see the room
                    self._release(head, pos + size, at)  # an early wrap leaves behind it
                    head = pos + size
                elif at is not None:
                    clean = at  # (one per lap: it ends at the buffer's end)
            pos += size
        if pos != head:
            self._release(head, pos, clean)
        return count

    if _native is None:
        poll = _poll_py

    def _poll_within_py(self, handler: Callable[[memoryview], object], limit: int, seconds: float) -> int:
        """``poll`` again and again, without yielding, until it hands payloads over or
        ``seconds`` pass: the count handed over (a consumer's hot look for the next record)."""
        end = time.perf_counter() + seconds
        while True:
            n = self.poll(handler, limit)
            if n or time.perf_counter() >= end:
                return n

    #: ``poll_within(handler, limit, seconds)``: the native twin of the method above where it is
    #: built (it watches the tail in C between polls).
    poll_within = _native.RingCore.poll_within if _native is not None else _poll_within_py

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

    def _release(self, head: int, pos: int, clean: int | None = None) -> None:
        """Free [head, pos) for the producers; an MPSC consumer zeroes it first, all but the
        body of the clean padding at ``clean`` (zero already)."""
        if self._multi_producer:
            if clean is not None and head <= clean < pos:
                self._zero(head, clean + HEADER_SIZE)
                self._zero((clean | self.mask) + 1, pos)
            else:
                self._zero(head, pos)
        self._head_local = pos
        self._head.store(pos, RELEASE)
        if self._flushing:
            self.mem.writeback(self._head_at, 8)

    def _zero(self, start: int, end: int) -> None:
        cap, data = self.capacity, self.data
        while start < end:
            idx = start & self.mask
            n = min(end - start, cap - idx)
            if n <= 256:  # a slice copy beats a ctypes call for a few words
                self.buf[data + idx:data + idx + n] = _SMALL_ZEROS[:n]
            else:
                self.mem.zero(data + idx, n)
            start += n

    def _past_corrupt(self, pos: int, tail: int) -> int:
        """Where the consumer resumes after a corrupt record at ``pos`` (counted in dropped):
        the tail, as nothing up to it can be trusted, but in an MPSC ring not past a claim a
        live producer is still writing. Freed, that claim's space is claimed again a lap later,
        and the producer's late copy would land in that record: the consumer stops at the
        first such claim, or waits at ``pos`` while one there lasts (HOLD_S at most; then it
        passes that one claim, and stops at the next)."""
        writing = sorted(w for w in self.writing_at(self._claims()) if pos <= w < tail)
        if writing and writing[0] == pos:
            if self._waiting("record", pos):
                return pos
            del writing[0]
        self.dropped += 1
        self._jumped_to = writing[0] if writing else None
        return writing[0] if writing else tail

    def _claims(self, live_claims: Callable[[], Collection[int]] | None = None) -> list[int]:
        """MPSC: the claim words ``live_claims`` (default: the ring's) returns that can be
        positions (aligned, below COUNTER_LIMIT: garbage over a word is no position); none
        without one."""
        source = live_claims or self.live_claims
        if not self._multi_producer or source is None:
            return []
        return [c for c in source() if sane(c)]

    def writing_at(self, claims: Collection[int]) -> set[int]:
        """The record starts producers holding these claims may be writing: each claim, and
        the start of the lap after it (where a record that did not fit before the end goes)."""
        mask = self.mask
        return set(claims) | {(c | mask) + 1 for c in claims if c & mask}

    def _waiting(self, kind: str, at: int) -> bool:
        """Start or go on with the consumer's hold of this kind at position ``at``: True until
        HOLD_S passed."""
        now = time.monotonic()
        hold = self._holds.get(kind)
        if hold is None or hold[0] != at:
            self._holds[kind] = (at, now + HOLD_S)
            return True
        if now < hold[1]:
            return True
        del self._holds[kind]
        return False

    def _bad_tail(self, tail: int) -> None:
        """The tail is garbage (behind the head, over a lap ahead, misaligned or huge).

        SPSC: the producer's tail is authoritative and it republishes it on every push, so
        an aligned, plausible tail is adopted (unread records are dropped) and the producer
        adopts our head in turn if it must; the two converge within two exchanges.  MPSC:
        claims in flight are lost; the data is cleared (keeping the zero-header invariant)
        and the tail moved back to the head with a CAS, so a concurrent claim wins; not while
        a live producer still writes a claim (anywhere: the tail was garbage), whose late copy
        would land in a record that reuses that space, for as long as the hold lasts.

        Memory without coherence: the tail's line is the producer's alone (the consumer's
        store would land whole over the producer's next tail, written back from its cache by
        its next invalidate, and hide the records that tail published): an unadoptable tail is
        dropped once and left to its producer, who republishes it with its next push. (An MPSC
        ring does not run there: its claims are read-modify-writes of the tail.)
        """
        head = self._head_local
        if not self._multi_producer and not tail & 7 and tail < COUNTER_LIMIT:
            self.dropped += 1
            self._head_local = tail
            self._store_head(tail)
            return
        if self._flushing:
            if tail != self._garbage_tail:
                self._garbage_tail = tail
                self.dropped += 1
                self._store_head(head)  # (our own counter: repaired, in case it was hit too)
            return
        if self._multi_producer:
            if self._claims() and self._waiting("tail", head):
                return  # looked at again by the next poll
            self.mem.zero(self.data, self.capacity)
        self.dropped += 1
        self._tail.cas(tail, head, ACQ_REL)
        self._store_head(head)  # and repair our own counter, in case it was hit too

    def free_space(self) -> int:
        """Bytes a producer could claim now (a snapshot)."""
        used = self._tail.load(ACQUIRE) - self._head.load(ACQUIRE)
        return self.capacity - min(max(used, 0), self.capacity)
