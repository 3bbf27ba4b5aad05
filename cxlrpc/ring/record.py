"""Record format shared by both rings.

A ring is a control block (``CONTROL_SIZE`` bytes: tail counter at +0, head counter at
+128, each on its own pair of cache lines) followed by a power-of-two data area.
A record is an 8-byte header word followed by the payload, padded to 8 bytes::

    bits  0..31  payload length
    bits 32..47  producer id (MPSC: who claimed the record, for dead-producer unblocking)
    bits 48..55  kind: DATA or PADDING (padding fills the end of the buffer on wrap-around)
    bits 56..61  producer tag (MPSC: e.g. the low bits of the producer's connection generation,
                 so a record of a slot's previous holder is told from its current holder's)
    bit  62      COMMITTED: the payload is complete and may be read
    bit  63      PAD_CLEAN (padding only): a producer's wrap over free space, whose body it never
                 wrote; an MPSC consumer clears only its header (free space reads zero already)

A producer wraps early, padding to the end of the buffer although its record would fit, when
its tail is ``hot_span`` or more into the buffer and the consumer has taken everything
(not over memory without coherence, where a padding's span would be flushed whole): request
and response traffic then keeps to the first pages of the ring, which stay in the caches, the
TLB and, under a hypervisor, its page tables, instead of walking all of them.

Header words are stored atomically (release on commit) through ``cxlrpc.memory``.
"""
from __future__ import annotations

CONTROL_SIZE = 256
TAIL_OFFSET = 0
HEAD_OFFSET = 128
HEADER_SIZE = 8

KIND_DATA = 1
KIND_PADDING = 2
COMMITTED = 1 << 62
PAD_CLEAN = 1 << 63
#: Early wraps start this far into the buffer (a quarter of it in rings under 64 KiB).
HOT_SPAN = 16 << 10
LENGTH_MASK = 0xFFFFFFFF
MAX_PRODUCER_ID = 0xFFFF
TAG_SHIFT = 56
TAG_MASK = 0x3F


def align8(n: int) -> int:
    """Round ``n`` up to a multiple of 8."""
    return (n + 7) & ~7


def make_header(length: int, kind: int, producer: int, committed: bool, tag: int = 0) -> int:
    """Pack a record header word."""
    return (COMMITTED if committed else 0) | (tag << TAG_SHIFT) | (kind << 48) | (producer << 32) | length


def header_producer(word: int) -> int:
    return (word >> 32) & 0xFFFF


def header_tag(word: int) -> int:
    return (word >> TAG_SHIFT) & TAG_MASK


def ring_size(capacity: int) -> int:
    """Bytes a ring of ``capacity`` data bytes occupies (control block included)."""
    check_capacity(capacity)
    return CONTROL_SIZE + capacity


def check_capacity(capacity: int) -> None:
    """Capacities are powers of two, at least 1 KiB, at most 2 GiB (lengths are 32-bit)."""
    if capacity < 1024 or capacity > (1 << 31) or capacity & (capacity - 1):
        raise ValueError(f"ring capacity must be a power of two in [1 KiB, 2 GiB], got {capacity}")


def max_payload(capacity: int) -> int:
    """Largest payload a ring accepts: half the capacity, so an empty ring always fits one
    record wherever its tail stands (wrap padding included)."""
    return capacity // 2 - HEADER_SIZE


def hot_span(capacity: int) -> int:
    """How far into a ring of ``capacity`` a producer's tail goes before it wraps early."""
    return min(HOT_SPAN, capacity // 4)
