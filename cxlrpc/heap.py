"""The heap of a server region: bodies too big for a ring travel here, out of line.

The server alone allocates (no shared allocator state: nothing to corrupt, nothing to CAS, one
writer per extent on memory without coherence). A response body is allocated by the server,
written, then referenced by a small frame (offset, length); the client copies it out and sends
a FREE frame. A request body is allocated on the client's behalf (an ALLOC round trip), written
by the client, referenced by its request frame, and freed by the server once it has read it.
Every extent belongs to one connection (slot, generation) and is freed once that one has
departed and is *fenced* (cxlrpc.fencing: it can no longer write into the region); until then
the connection is quarantined and nothing it held is handed to another.
Offsets and lengths read from frames are checked against what was handed out.

A big response on coherent memory is *followed*: the server sends its frame first, then writes
the body a chunk at a time after a progress word (the extent's first FOLLOW_HEADER bytes), and
the client copies each chunk out as it lands, so the two copies overlap instead of adding up.
A big request is followed the same way, writer and reader swapped (its extent ALLOCed first);
the server takes it a step at a time between its other work, never waiting long for one client.
A followed request's extent may be granted as a *spare* (SPARE_MAX, SPARE_SHARE): the server
never frees one on its own; once read it is the client's again, which keeps one for its next
followed request (no ALLOC round trip then) and FREEs the others; its departure frees them all.
A followed reply's extent that its client FREEs is *parked* for that connection's next followed
reply (no allocator work on either side of a big call: 5.5 us a pair here), and freed when a
bigger one is needed, when the heap has no room for another extent, or when the client leaves.

On memory without coherence (flush mode) each side copies a body through the heap once: one
written whole is streamed in (nothing left to write back; a store fence before its frame is
pushed) and copied out a chunk at a time, each chunk invalidated right before it is copied
(``Lines.write_body`` / ``read_body``); a followed one (from FOLLOW_MIN, both ways, as on coherent
memory) is streamed in a chunk at a time, the progress word stored and its line written back after
each, while its reader invalidates the progress word's line before each look and each run of
bytes right before copying it, the seal's line before each check (``memory.publish_copy`` /
``follow_copy`` / ``FollowedBody``). The progress word there has a line of its own
(FLUSH_PROGRESS_AT; the body from FLUSH_FOLLOW_HEADER), apart from the seal's: a request's
progress word is its client's, its seal the server's, and no line has two writers. The native
caller and dispatcher follow nothing there (they have no write-backs). Below FOLLOW_MIN bodies stay
in the rings, whose native paths copy them (an echo between processes here, p50, with the native
flush rings: 1 MiB 951-966 us through the rings, 470-478 followed; 64 KiB 55 us through the
rings, 125-175 followed by the Python paths).

A followed extent is *sealed*: the word after its progress word (SEAL_AT) holds its owner's
``seal_word`` from when the server hands it out (a followed reply's, an ALLOC asked for a
followed request) and 0 from when its owner departs. Its client checks the seal before each
chunk it writes (and each progress store) and after each body it reads (seqlock-style), so a
client frozen past its reaping writes at most the chunk it was in, and never returns bytes of
an extent no longer its own (Unavailable instead).
"""
from __future__ import annotations

import struct
from typing import Sequence

from .allocator import PoolAllocator
from .memory import (ACQUIRE, RELEASE, AtomicMemory, BytesLike, FollowedBody, SealBroken, copy_bytes, follow_copy, plain_bytes,
                     plain_copy, publish_copy, to_bytes)

EXTENT = struct.Struct("<QQ")  # offset, length: the body of a HEAP frame
OFFSET = struct.Struct("<Q")   # FREE's offset (and a CREDIT's count)
GRANT = struct.Struct("<QQ")   # ALLOC's size and whether a spare is asked; its grant's offset and if it is one
UNIT = 4096
FOLLOW_HEADER = 64  # a followed extent: its progress word (u64), its seal (u64), from here its body
SEAL_AT = 8  # a followed extent's seal word, after its progress word
#: Without coherence a followed extent's progress word (its writer's: a client's, for a request)
#: has a line of its own, apart from the seal's (the server's): the seal at SEAL_AT, the progress
#: word at FLUSH_PROGRESS_AT, the body from FLUSH_FOLLOW_HEADER.
FLUSH_PROGRESS_AT = 64
FLUSH_FOLLOW_HEADER = 128
SEAL_REVOKED = 0  # the seal of an extent whose owner departed (no seal_word is 0)
#: what a client says when a followed body's seal is not its own (the native caller's words too)
SEAL_BROKEN = "the extent's seal is not this client's: the server reaped it (the bytes may be another's)"
#: Responses from this size up are followed; below it the heap's allocation and FREE cost more
#: than the overlap gains (echo p50 here: 64 KiB 11-18 against 26 us followed, 128 KiB 20-30
#: against 37-41, 256 KiB 66-68 against 58).
FOLLOW_MIN = 256 << 10
#: A followed body whose writer makes no progress for this long is given up (the server died
#: or froze mid-copy; about when its missing heartbeat would tell), as is one that takes longer
#: than that plus its length at FOLLOW_MIN_RATE bytes/s (a writer dripping bytes to hold the
#: reader: the client's loop waits while it follows).
FOLLOW_STALL_S = 1.0
FOLLOW_MIN_RATE = 100e6
FOLLOW_ABORTED = (1 << 64) - 1  # a progress word past any length: the writer gave up
#: The server follows a request's body a step at a time: on while the client's writes keep
#: coming (up to FOLLOW_SPIN_S between them), for at most FOLLOW_STEP_S before it serves others.
FOLLOW_SPIN_S = 50e-6
FOLLOW_STEP_S = 1e-3
#: A followed request whose writer made no progress at the server's last looks (a few loop
#: turns in a row) is looked at again after twice the pause before it (from FOLLOW_SPIN_S), at
#: most this long, and without spinning: idle ones cost the loop a look now and then, not a spin every turn (1,561 kept
#: alive by a progress bump a second took a bystander's echo p50 from 0.04 to 106-130 ms).
FOLLOW_IDLE_MAX_S = 10e-3
#: A client asks for its followed requests' extents as spares: granted up to SPARE_MAX bytes
#: each while they add up to at most the heap beyond max_message_size (the default heap adds
#: 1/SPARE_SHARE of it: 8 MiB to the default 64 MiB), so that a body of max_message_size still
#: fits. A spare is its client's again once the server has read its body, to write its next
#: followed request into at once.
SPARE_MAX = (2 << 20) + FLUSH_FOLLOW_HEADER
SPARE_SHARE = 8


def seal_word(slot: int, gen: int) -> int:
    """The seal of a followed extent handed to the connection (slot, generation): odd, so never
    SEAL_REVOKED, and mixed, so a body's bytes where an extent's header was are unlikely to
    read as one (the native caller's follow_seal, cxlrpc/_follow.h)."""
    return (((gen & 0xFFFFFFFF) << 32 | (slot & 0x7FFFFFFF) << 1 | 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF


class HeapAccess:
    """Reading and writing extents of the heap at ``start`` (``size`` bytes) of a region; a
    client's with the ``seal`` its followed extents hold while they are its own."""

    def __init__(self, buf: memoryview, mem: AtomicMemory, start: int, size: int,
                 seal: int | None = None) -> None:
        self.buf, self.mem, self.start, self.size = buf, mem, start, size
        self.own_seal = seal
        #: a followed extent's header (its body starts there) and where its progress word is
        self.header, self.progress_at = (FLUSH_FOLLOW_HEADER, FLUSH_PROGRESS_AT) if mem.flushing else (FOLLOW_HEADER, 0)

    def check(self, offset: int, length: int) -> None:
        """Raise ValueError unless ``[offset, offset+length)`` lies inside the heap."""
        if not (0 <= offset and 0 <= length and offset + length <= self.size and offset % UNIT == 0):
            raise ValueError(f"extent ({offset}, {length}) is not inside the {self.size}-byte heap")

    def write(self, offset: int, parts: Sequence[BytesLike]) -> int:
        """Copy ``parts`` to ``offset``; the bytes written. Plain stores on coherent memory, as
        publish_copy; without coherence, streaming stores (``Lines.write_body``: nothing left
        to write back, one store fence before the frame that publishes them), or where the
        native module is missing a copy and its write-back."""
        length = sum(len(part) for part in parts)
        self.check(offset, length)
        at = self.start + offset
        lines = self.mem.lines
        if lines is not None:
            for part in parts:
                lines.write_body(at, part)
                at += len(part)
            return length
        for part in parts:
            n = len(part)
            if self.mem.flushing:
                copy_bytes(self.buf[at:at + n], part)
            else:
                plain_copy(self.buf[at:at + n], part)
            at += n
        self.mem.writeback(self.start + offset, length)
        return length

    def begin_publish(self, offset: int) -> None:
        """Zero the progress word of a followed extent, before its frame is sent (a client's
        only while the extent holds its seal: else SealBroken, nothing stored)."""
        self.check(offset, self.header)
        at = self.start + offset
        if self.own_seal is not None:
            self.mem.invalidate(at + SEAL_AT, 8)
            if self.mem.load(at + SEAL_AT, ACQUIRE) != self.own_seal:
                raise SealBroken("the extent's seal is not this client's")
        self.mem.store(at + self.progress_at, 0, RELEASE)
        self.mem.writeback(at + self.progress_at, 8)  # (before the frame's push, which fences)

    def seal(self, offset: int, word: int) -> None:
        """Set the seal of the followed extent at ``offset`` (the server, handing it out or
        taking it back; written back: the frame that hands it out is pushed after)."""
        self.check(offset, self.header)
        self.mem.store(self.start + offset + SEAL_AT, word, RELEASE)
        self.mem.writeback(self.start + offset + SEAL_AT, 8)

    def publish(self, offset: int, body: BytesLike) -> None:
        """Write ``body`` into the followed extent at ``offset``, publishing its progress; if
        the copy fails, a progress word no writer stores tells the reader at once. A client's
        extent must hold its seal before each chunk, else the copy stops there and SealBroken
        is raised, the extent no longer touched: it is not ours."""
        self.check(offset, self.header + len(body))
        at, seal = self.start + offset, self.own_seal
        progress = at + self.progress_at
        try:
            if seal is None:
                publish_copy(self.mem, self.buf, progress, at + self.header, body)
            else:
                publish_copy(self.mem, self.buf, progress, at + self.header, body, at + SEAL_AT, seal)
        except SealBroken:
            raise
        except BaseException:
            self.mem.store(progress, FOLLOW_ABORTED, RELEASE)
            self.mem.writeback(progress, 8)
            raise

    def follow(self, offset: int, length: int) -> bytes:
        """A copy of the followed extent's body, taken as its writer publishes it (ValueError
        for a bad extent or progress word, TimeoutError if the writer stops for FOLLOW_STALL_S
        or is slower than FOLLOW_MIN_RATE; for a client, SealBroken when, once copied, the
        extent's seal is not its own: the copy may hold another's bytes)."""
        self.check(offset, self.header + length)
        at, seal = self.start + offset, self.own_seal
        stall, limit = FOLLOW_STALL_S, FOLLOW_STALL_S + length / FOLLOW_MIN_RATE
        progress, body = at + self.progress_at, at + self.header
        if seal is None:
            return follow_copy(self.mem, self.buf, progress, body, length, stall, limit)
        return follow_copy(self.mem, self.buf, progress, body, length, stall, limit, at + SEAL_AT, seal)

    def follower(self, offset: int, length: int, copy: bool) -> FollowedBody:
        """The followed extent's body, to take a step at a time (ValueError for a bad extent)."""
        self.check(offset, self.header + length)
        at = self.start + offset
        return FollowedBody(self.mem, self.buf, at + self.progress_at, at + self.header, length, copy)

    def progress(self, offset: int) -> int:
        """The progress word of the followed extent at ``offset`` (its line invalidated first)."""
        at = self.start + offset + self.progress_at
        self.mem.invalidate(at, 8)
        return int(self.mem.load(at, ACQUIRE))

    def followed_view(self, offset: int, length: int) -> memoryview:
        """A read-only view of a complete followed extent's body, in place (its lines
        invalidated first: without coherence its follower only waited for it)."""
        self.check(offset, self.header + length)
        at = self.start + offset + self.header
        self.mem.invalidate(at, length)
        return self.buf[at:at + length].toreadonly()

    def view(self, offset: int, length: int) -> memoryview:
        """A read-only view of the extent, in place (its lines invalidated first)."""
        self.check(offset, length)
        at = self.start + offset
        self.mem.invalidate(at, length)
        return self.buf[at:at + length].toreadonly()

    def read(self, offset: int, length: int) -> bytes:
        """A copy of the extent (its lines invalidated first: another host wrote them; with
        the native module, a chunk at a time right before it is copied: ``Lines.read_body``)."""
        self.check(offset, length)
        at = self.start + offset
        lines = self.mem.lines
        if lines is not None:
            return lines.read_body(at, length)
        self.mem.invalidate(at, length)
        view = self.buf[at:at + length]
        return to_bytes(view) if self.mem.flushing else plain_bytes(view)


class ServerHeap:
    """The server's allocator over the heap, with each extent's owner (slot, generation)."""

    def __init__(self, access: HeapAccess, spare_budget: int = 0) -> None:
        self.access = access
        self._alloc = PoolAllocator(access.size, UNIT)
        self._owners: dict[int, tuple[int, int, int]] = {}  # offset -> (slot, gen, length)
        self._lent: set[int] = set()  # extents a handler still reads: kept past their owner
        self._kept: dict[int, int] = {}  # offset -> length, of extents granted as spares
        self._spare_budget = spare_budget
        self.kept_bytes = 0
        self._replies: set[int] = set()  # extents of followed replies (parked when FREEd)
        self._parked: dict[tuple[int, int], int] = {}  # (slot, gen) -> its parked reply extent
        self._parked_at: set[int] = set()
        self._parked_bytes = 0
        self._quarantined: set[tuple[int, int]] = set()  # departed, not yet fenced
        self._sealed: set[int] = set()  # followed extents: their header holds a seal
        #: followed requests' extents the server stopped reading while their writers may write
        #: on: offset -> body length (freed once the progress word says the writer stopped)
        self.abandoned: dict[int, int] = {}
        self._handed_back: set[int] = set()  # spares their client FREEd while the server read them

    def alloc(self, slot: int, gen: int, length: int, keep: bool = False) -> int | None:
        """An extent of ``length`` bytes for the connection, or None while the heap is full;
        granted as a spare if ``keep`` is asked, it is small enough and the budget allows."""
        offset = self._alloc.alloc(max(length, 1))
        if offset is None and self._parked:  # parked extents never keep a request out
            for parked in list(self._parked.values()):
                self._unpark(parked)
                self._drop(parked)
            offset = self._alloc.alloc(max(length, 1))
        if offset is None:
            return None
        self._owners[offset] = (slot, gen, length)
        if keep:  # asked by a client for a followed request: its header is sealed
            self._seal(offset, slot, gen, length)
        if keep and length <= SPARE_MAX and self.kept_bytes + length <= self._spare_budget:
            self._kept[offset] = length
            self.kept_bytes += length
        return offset

    def _seal(self, offset: int, slot: int, gen: int, length: int) -> None:
        if length >= self.access.header:
            self.access.seal(offset, seal_word(slot, gen))
            self._sealed.add(offset)

    def alloc_reply(self, slot: int, gen: int, length: int) -> int | None:
        """An extent for a followed reply of ``length`` bytes: the one the connection gave back
        last when it holds them without doubling them, else a new one (None while the heap is
        full)."""
        offset = self._parked.get((slot, gen))
        if offset is not None:
            self._unpark(offset)
            if length <= self._alloc.size_of(offset) <= 2 * max(length, UNIT):
                self._owners[offset] = (slot, gen, length)
                return offset  # (sealed for the connection already)
            self._drop(offset)
        offset = self.alloc(slot, gen, length)
        if offset is not None:
            self._replies.add(offset)
            self._seal(offset, slot, gen, length)
        return offset

    def is_spare(self, offset: int) -> bool:
        """Was the extent granted as a spare (and not FREEd since)?"""
        return offset in self._kept

    def owned(self, offset: int, length: int, slot: int, gen: int) -> bool:
        """Was this extent (at least ``length`` bytes) handed to that connection, and is no
        handler reading it (a lent extent is named by its one request only)?"""
        owner = self._owners.get(offset)
        return (owner is not None and owner[:2] == (slot, gen) and length <= owner[2]
                and offset not in self._lent and offset not in self._parked_at)

    def free(self, offset: int, slot: int, gen: int) -> bool:
        """Free the connection's extent at ``offset``; False if it is not one of its own, or
        a handler still reads it (it is freed by ``give_back``, never under the handler;
        a spare is freed then too: True). A followed reply's extent is parked instead, if the
        connection has none parked yet."""
        owner = self._owners.get(offset)
        if (owner is None or owner[:2] != (slot, gen) or offset in self._parked_at
                or owner[:2] in self._quarantined):
            return False
        if offset in self._lent:
            if self._unkeep(offset):  # its client is done writing it: free it once read
                self._handed_back.add(offset)
                return True
            return False
        self._unkeep(offset)
        if offset in self._replies and (slot, gen) not in self._parked:
            self._parked[(slot, gen)] = offset
            self._parked_at.add(offset)
            self._parked_bytes += self._alloc.size_of(offset)
            return True
        self._drop(offset)
        return True

    def lend(self, offset: int) -> None:
        """A handler reads the extent in place past this call: keep it, even if its owner
        departs, until ``give_back``."""
        self._lent.add(offset)

    def give_back(self, offset: int) -> bool:
        """The server is done with a lent extent: free it (its owner may be gone), but a
        spare, which is its client's again; whether it was freed."""
        self._lent.discard(offset)
        owner = self._owners.get(offset)
        if offset in self._kept or owner is None or owner[:2] in self._quarantined:
            return False  # (a quarantined owner's extents are freed when it is fenced)
        self._drop(offset)
        return True

    def abandon(self, offset: int, length: int) -> bool:
        """The server stopped reading a followed request (its writer stalled, its deadline
        passed, its caller cancelled or left) whose writer may still be writing: end the lending
        and, unless it is a spare (its client's again) or its owner is quarantined (freed when
        fenced), free it once its progress word reaches ``length`` (``free_abandoned``; at
        once if it has). Whether any abandoned extent was freed now."""
        self._lent.discard(offset)
        owner = self._owners.get(offset)
        if offset in self._kept or owner is None or owner[:2] in self._quarantined:
            return False
        if offset in self._handed_back:  # its writer is done: its client said so
            self._drop(offset)
            return True
        self.abandoned[offset] = length
        return self.free_abandoned() > 0

    def free_abandoned(self) -> int:
        """Free the abandoned extents whose writers stopped (their progress word at or past
        the length: done, or given up); how many (from housekeeping: O(abandoned))."""
        done = [offset for offset, length in self.abandoned.items() if self.access.progress(offset) >= length]
        for offset in done:
            self._drop(offset)
        return len(done)

    def quarantine(self, slot: int, gen: int) -> None:
        """The connection departed but may still write (frozen): keep all it holds, parked
        extent included, from every other connection until ``release_owner``."""
        self._quarantined.add((slot, gen))
        parked = self._parked.get((slot, gen))
        if parked is not None:
            self._unpark(parked)  # (a heap under pressure frees parked extents: not this one)
        for offset, (s, g, _) in self._owners.items():
            if s == slot and g == gen:
                self.abandoned.pop(offset, None)  # (freed when fenced, whatever its progress)
                if offset in self._sealed:
                    self.access.seal(offset, SEAL_REVOKED)  # it writes and reads no more of it

    def release_owner(self, slot: int, gen: int) -> int:
        """Free everything a departed (and fenced) connection held, but what is lent (freed
        when given back); how many extents. On memory without coherence each extent is written
        back first: a holder that died on this host may have left lines of it dirty in this
        host's caches, which would land whenever evicted, over the extent's next owner's bytes
        (a holder of another host is beyond this: see docs/operations.md)."""
        self._quarantined.discard((slot, gen))
        parked = self._parked.get((slot, gen))
        if parked is not None:
            self._unpark(parked)
        freed = 0
        for offset in [off for off, (s, g, _) in self._owners.items() if (s, g) == (slot, gen)]:
            self._write_back(offset)
            self._unkeep(offset)
            if offset not in self._lent:
                self._drop(offset)
                freed += 1
        return freed

    def _write_back(self, offset: int) -> None:
        """Write the extent at ``offset`` back (memory without coherence; a no-op elsewhere)."""
        access = self.access
        if access.mem.flushing:
            access.mem.writeback(access.start + offset, self._alloc.size_of(offset))

    def _unpark(self, offset: int) -> None:
        slot, gen, _ = self._owners[offset]
        del self._parked[(slot, gen)]
        self._parked_at.discard(offset)
        self._parked_bytes -= self._alloc.size_of(offset)

    def _drop(self, offset: int) -> None:
        """Free the extent at ``offset`` (not parked, not lent)."""
        del self._owners[offset]
        self._replies.discard(offset)
        self.abandoned.pop(offset, None)
        self._handed_back.discard(offset)
        if offset in self._sealed:  # a writer still at it (a request the server gave up) stops
            self._sealed.discard(offset)
            self.access.seal(offset, SEAL_REVOKED)
        self._alloc.free(offset)

    def _unkeep(self, offset: int) -> bool:
        length = self._kept.pop(offset, None)
        if length is None:
            return False
        self.kept_bytes -= length
        return True

    @property
    def used(self) -> int:
        """Bytes in extents the connections hold (parked ones are free for the next alloc)."""
        return self._alloc.used - self._parked_bytes
