"""Garbage for a live server region, written from the test process (which maps it too): random
bytes and well-formed-looking frames, ring records, counters and words, area by area.

What is written is what a broken or hostile peer could write *without being able to pass for
another peer*: no frame carries a live connection's own (slot, generation) together with a call
id it may be waiting for, or with a heap extent it may hold (such a frame is a forgery that no
check in a shared region can tell from the real one); ring garbage goes into free space and is
made reachable by moving counters (bytes written inside a record in flight change that message
in place, which only a seal could detect: issue 40's fencing); heap progress words are changed
only to values a reader can tell are wrong. Everything else goes.
"""
from __future__ import annotations

import os
import random
import time

from cxlrpc import frame as fr
from cxlrpc.channel import (_F_GRANT, _SLOT_ACK, _SLOT_CLAIM, _SLOT_HEARTBEAT, _SLOT_IDENTITY, _SLOT_PARKED,
                            _SLOT_PID, _SLOT_STATE, _SLOT_WRITER, CONTROL, SLOT_STRIDE, Geometry)
from cxlrpc.heap import EXTENT, FOLLOW_ABORTED, GRANT, OFFSET, UNIT
from cxlrpc.memory import ACQ_REL, ACQUIRE, RELEASE
from cxlrpc.region import _OWNER_STATE, _PID, Region
from cxlrpc.ring import MpscRing
from cxlrpc.ring.mpsc import NO_CLAIM
from cxlrpc.ring.record import (CONTROL_SIZE, HEAD_OFFSET, KIND_DATA, KIND_PADDING, LENGTH_MASK, PAD_CLEAN,
                                TAIL_OFFSET, make_header)

DROPPED = CONTROL + 256  # the control block's dropped-frames counter
_SERVER_PARKED = CONTROL + 128
_GEOMETRY = [CONTROL + off for off in (8, 16, 24, 32, 40)]  # slots, capacities, heap, max message
#: Call ids from here up are never a real call's (a client counts from 1): a frame with a live
#: connection's identity and such an id is garbage its client must ignore, not a forgery.
FORGED_IDS = 1 << 48
_KINDS = sorted(fr._KINDS)


def _word(rng: random.Random, near: int = 0) -> int:
    """A plausible-or-not u64: near a real value, small, aligned, huge, or random."""
    return rng.choice((near, near + 8, near - 8 if near >= 8 else 0, near + 3, near + (1 << 40),
                       rng.randrange(1 << 16), rng.randrange(1 << 32) & ~7, rng.getrandbits(64),
                       (1 << 64) - 1, 1 << 63, 0, 1, 2))


class Crafter:
    """Well-formed-looking frames and ring records for one region (never forgeries)."""

    def __init__(self, rng: random.Random, geo: Geometry) -> None:
        self.rng, self.geo = rng, geo
        self.live: list[tuple[int, int]] = []  # (slot, generation) of the connections held now
        #: ALLOCs in a live connection's name: granted, its extents are held until it departs,
        #: so a flood of them fills the heap (issue 40 item 5): the heap area's only
        self.alloc_as_live = False

    def identity(self, exact_ok: bool) -> tuple[int, int, int]:
        """(slot, generation, call id) of a frame."""
        rng, live = self.rng, self.live
        if live and exact_ok and rng.random() < 0.3:  # a live connection, a call it never made
            slot, gen = rng.choice(live)
            return slot, gen, rng.randrange(FORGED_IDS, 1 << 64)
        call_id = rng.choice((rng.randrange(1, 2000), rng.getrandbits(64), 0))
        r = rng.random()
        if live and r < 0.5:  # a live slot, another generation
            slot, gen = rng.choice(live)
            return slot, (gen + rng.choice((1, 2, -1, -2, 1 << 31, 64))) & 0xFFFFFFFF, call_id
        if r < 0.8:  # some slot of the table (free or not), any generation
            return rng.randrange(self.geo.slots), rng.getrandbits(32), call_id
        return rng.choice((self.geo.slots, self.geo.slots + 1, 0xFFFF, rng.randrange(1 << 16))), \
            rng.getrandbits(32), call_id

    def extent(self) -> bytes:
        rng, size = self.rng, max(self.geo.heap_size, UNIT)
        offset = rng.choice((rng.randrange(size // UNIT) * UNIT, 0, size - UNIT, size, rng.getrandbits(64),
                             rng.randrange(size)))
        length = rng.choice((rng.randrange(1, 8 << 20), 0, UNIT, size, size + 1, rng.getrandbits(64),
                             self.geo.max_message_size))
        return EXTENT.pack(offset, length)

    def frame(self, to_server: bool, kind: int | None = None) -> bytes:
        """One frame a peer could have written (of ``kind``, or any), wrong in one or more ways."""
        rng = self.rng
        if kind is None:
            common = [fr.REQUEST] * 4 + [fr.ALLOC, fr.FREE] if to_server else [fr.RESPONSE] * 4 + [fr.ERROR]
            kind = rng.choice(_KINDS + common)
        if kind is None and rng.random() < 0.05:
            kind = rng.randrange(256)
        flags = rng.choice((0, fr.RAW, fr.RAW, fr.HEAP, fr.HEAP | fr.FOLLOW, fr.HEAP | fr.RAW,
                            fr.HEAP | fr.FOLLOW | fr.RAW, fr.META | fr.RAW, fr.STREAM, fr.IN_PLACE | fr.RAW,
                            rng.randrange(64), rng.randrange(256)))
        # extents a live connection holds: never named in its name
        exact_ok = not flags & fr.HEAP and kind != fr.FREE and (kind != fr.ALLOC or self.alloc_as_live)
        slot, gen, call_id = self.identity(exact_ok)
        status = rng.choice((0, 0, rng.randrange(1, 17), rng.randrange(1 << 16)))
        timeout = rng.choice((0.0, 0.5, 2.0, -1.0, float("nan"), float("inf"), 1e-9, 1e300))
        method = rng.choice((b"echo", b"echo", b"echo", b"cxlrpc.health", b"", b"m" * 255,
                             rng.randbytes(rng.randrange(1, 12))))
        mlen = len(method) if rng.random() < 0.85 else rng.choice((0, 255, 256, 65535, len(method) + 1))
        if flags & fr.HEAP:
            body = self.extent()
        elif kind == fr.ALLOC:  # small when it may be granted to a live connection
            body = GRANT.pack(rng.choice((rng.randrange(1, 16 << 10), 0, 1 << 40, rng.getrandbits(64))),
                              rng.randrange(3))
        elif kind in (fr.FREE, fr.CREDIT):
            body = OFFSET.pack(rng.choice((rng.randrange(max(self.geo.heap_size, UNIT) // UNIT) * UNIT,
                                           rng.getrandbits(64), 0, 1)))
        else:
            body = rng.randbytes(rng.randrange(0, 200))
        if flags & fr.META:
            body = fr._META_LEN.pack(rng.choice((rng.randrange(40), 4096, 65535))) + rng.randbytes(
                rng.randrange(40)) + body
        data = fr.HEADER.pack(kind, flags, status, slot, gen, call_id, timeout, mlen) + method + body
        if rng.random() < 0.08:
            data = data[:rng.randrange(len(data) + 1)]
        return data

    def records(self, to_server: bool, budget: int, max_payload: int) -> bytes:
        """Ring records (headers of plausible kinds, lengths, producers and tags, mostly
        committed) holding crafted frames: at most ``budget`` bytes, a multiple of 8."""
        rng, out = self.rng, bytearray()
        while len(out) + 8 <= budget:
            body = self.frame(to_server) if rng.random() < 0.85 else rng.randbytes(rng.randrange(64))
            length = len(body)
            if rng.random() < 0.1:
                length = rng.choice((0, length + 8, max(length - 1, 0), max_payload + 8, LENGTH_MASK,
                                     rng.getrandbits(32)))
            kind = KIND_DATA if rng.random() < 0.8 else rng.choice((KIND_PADDING, rng.randrange(256)))
            producer = rng.choice([s for s, _ in self.live] + [rng.randrange(self.geo.slots), 0xFFFF])
            word = make_header(length & LENGTH_MASK, kind, producer, rng.random() < 0.85, rng.randrange(64))
            if rng.random() < 0.05:
                word |= PAD_CLEAN
            out += word.to_bytes(8, "little") + body + bytes(-len(body) % 8)
        return bytes(out[:budget - budget % 8])


class RegionFuzzer:
    """Writes garbage into one area of a live server region: ``op()`` writes one burst."""

    AREAS = ("request-ring", "reply-ring", "slots", "slot-owner", "heap", "claim", "owner", "geometry")

    def __init__(self, region: Region, geo: Geometry, area: str, rng: random.Random) -> None:
        if area not in self.AREAS:
            raise ValueError(area)
        self.region, self.geo, self.area, self.rng = region, geo, area, rng
        self.mem = region.mem
        self.crafter = Crafter(rng, geo)
        self.crafter.alloc_as_live = area == "heap"
        self.flush = geo.per_client_requests
        self.ops = 0
        self._heap_writes = 0
        self._real = {at: self.load(at) for at in _GEOMETRY}  # the geometry the server wrote

    # ------------------------------------------------------------------ memory, either coherence
    def load(self, at: int) -> int:
        self.mem.invalidate(at, 8)
        return self.mem.load(at, ACQUIRE)

    def store(self, at: int, value: int) -> None:
        self.mem.store(at, value & ((1 << 64) - 1), RELEASE)
        self.mem.writeback(at, 8)

    def put(self, at: int, data: bytes) -> None:
        self.region.buf[at:at + len(data)] = data
        self.mem.writeback(at, len(data))

    def held(self) -> list[tuple[int, int]]:
        """(slot, generation) of every slot held now."""
        out = []
        for i in range(self.geo.slots):
            word = self.load(self.geo.slot(i) + (_F_GRANT if self.flush else _SLOT_STATE))
            if word & 1:
                out.append((i, (word >> 1) & (0x7FFFFFFF if self.flush else 0xFFFFFFFF)))
        return out

    # ------------------------------------------------------------------ one burst
    def op(self) -> None:
        if self.ops % 16 == 0:
            self.crafter.live = self.held()
        self.ops += 1
        getattr(self, "_" + self.area.replace("-", "_"))()

    def _victim(self) -> tuple[int, int] | None:
        live = self.crafter.live
        return self.rng.choice(live) if live else None

    def _request_ring(self) -> None:
        if self.flush:  # one request ring per client: a live one
            victim = self._victim()
            if victim is None:
                return
            self._ring(self.geo.client_request_ring(victim[0]), self.geo.request_capacity, True, True)
            return
        rng = self.rng
        if rng.random() < 0.15:  # committed garbage, pushed as a producer would (a free slot's id)
            free = sorted(set(range(self.geo.slots)) - {s for s, _ in self.crafter.live}) or [0xFFFF]
            ring = MpscRing(self.region.buf, self.mem, self.geo.request_ring, self.geo.request_capacity)
            ring.try_push(self.crafter.frame(True), rng.choice(free))
        elif rng.random() < 0.1:  # the server's doorbell word
            self.store(_SERVER_PARKED, _word(rng, self.load(_SERVER_PARKED)))
        else:
            self._ring(self.geo.request_ring, self.geo.request_capacity, True, False)

    def _reply_ring(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        if self.rng.random() < 0.1:  # the client's doorbell word
            at = self.geo.slot(victim[0]) + (256 if self.flush else _SLOT_PARKED)
            self.store(at, _word(self.rng, self.load(at)))
        else:
            self._ring(self.geo.response_ring(victim[0]), self.geo.response_capacity, False, True)

    def _ring(self, ring: int, capacity: int, to_server: bool, spsc: bool) -> None:
        """Garbage in a ring's free space (random, or crafted records), or its counters moved
        (so that the consumer reads that garbage, or skips records, or sees nonsense)."""
        rng = self.rng
        tail, head = self.load(ring + TAIL_OFFSET), self.load(ring + HEAD_OFFSET)
        sound = not (tail | head) & 7 and 0 <= tail - head <= capacity
        r = rng.random()
        if sound and r < 0.55:
            window = (_spsc_free if spsc else _mpsc_free)(tail, head, capacity)
            if window is None:
                return
            start, end = window
            at = start + (rng.randrange(0, end - start - 7) & ~7)
            budget = min(end - at, rng.choice((8, 64, 512, 4096)))
            if rng.random() < 0.4:
                data = rng.randbytes(budget)
            else:
                data = self.crafter.records(to_server, budget, capacity // 2 - 8)
            self._put_ring(ring, capacity, at, data)
            if rng.random() < 0.5:  # make it reachable: a tail past it (MPSC: records are
                # committed by their header), or (SPSC: by the tail) a head past it, where
                # the producer resumes, so that the consumer reads what lies between
                self.store(ring + (HEAD_OFFSET if spsc else TAIL_OFFSET), at + len(data))
        elif r < 0.85:
            if spsc:  # only tails a consumer can tell are wrong: see _spsc_free
                bad = (tail + 3, head - 8 * rng.randrange(1, 64), head + capacity + 8 * rng.randrange(1, 64),
                       1 << 62, rng.getrandbits(64) | 1)
            else:
                bad = (_word(rng, tail), head + capacity, head, tail + capacity, head + 8 * rng.randrange(1, 64))
            self.store(ring + TAIL_OFFSET, rng.choice(bad))
        else:
            self.store(ring + HEAD_OFFSET, _word(rng, head))

    def _put_ring(self, ring: int, capacity: int, pos: int, data: bytes) -> None:
        data_at = ring + CONTROL_SIZE
        idx = pos & (capacity - 1)
        first = data[:capacity - idx]
        self.put(data_at + idx, first)
        if len(first) < len(data):
            self.put(data_at, data[len(first):])

    def _slots(self) -> None:
        """Free slots' bytes and words; a live slot's heartbeat, doorbell and acknowledgement."""
        rng, geo = self.rng, self.geo
        live = dict(self.held())  # (fresh: a slot claimed a moment ago is no longer free)
        if rng.random() < 0.3 or not live:  # a slot nobody holds: random bytes, or a plausible claim
            free = [i for i in range(geo.slots) if i not in live]
            if not free:
                return
            base = geo.slot(rng.choice(free))
            if rng.random() < 0.5:
                self.put(base, rng.randbytes(SLOT_STRIDE))
            else:
                self.store(base + rng.choice((_SLOT_STATE, _SLOT_HEARTBEAT, _SLOT_PID, _SLOT_WRITER,
                                              _SLOT_IDENTITY, _SLOT_ACK, _SLOT_CLAIM)), _word(rng, 1))
            return
        at = geo.slot(rng.choice(list(live))) + rng.choice((_SLOT_HEARTBEAT, _SLOT_PARKED, _SLOT_ACK))
        self.store(at, _word(rng, self.load(at)))

    def _slot_owner(self) -> None:
        """The words that say who holds a live slot (state, PID, identity, writer): the server
        may take its holder for gone (or replaced), but frees what it held only once the holder
        is fenced (its process exited): its heap bodies stay its own."""
        rng, geo = self.rng, self.geo
        live = dict(self.crafter.live)
        if not live:
            return
        slot = rng.choice(list(live))
        gen, base = live[slot], geo.slot(slot)
        at = base + rng.choice((_SLOT_PID, _SLOT_IDENTITY, _SLOT_WRITER, _SLOT_STATE))
        value = _word(rng, self.load(at))
        if at == base + _SLOT_STATE:
            value = rng.choice((value, ((gen + 1) << 1) | 1, gen << 1, ((gen - 1) << 1) | 1))
        elif at == base + _SLOT_PID:
            value = rng.choice((value, os.getpid(), 1, 4_000_000))
        elif at == base + _SLOT_WRITER:
            value = rng.choice((value, gen + 1, gen - 1))
        self.store(at, value)

    def _claim(self) -> None:
        """A live client's claim word (issue 40 item 7), sometimes with the tail moved too."""
        victim = self._victim()
        if victim is None:
            return
        rng, ring = self.rng, self.geo.request_ring
        head, tail = self.load(ring + HEAD_OFFSET), self.load(ring + TAIL_OFFSET)
        self.store(self.geo.slot(victim[0]) + _SLOT_CLAIM,
                   rng.choice((head, head + 8, tail, tail + 8, NO_CLAIM, _word(rng, head))))
        if rng.random() < 0.3:
            self.store(ring + TAIL_OFFSET, tail + 8)

    def _heap(self) -> None:
        """Progress words of followed extents changed to values a reader must refuse; ALLOC,
        FREE and HEAP frames that name extents of no one, or of another connection."""
        rng, geo = self.rng, self.geo
        if rng.random() < 0.3:
            ring = MpscRing(self.region.buf, self.mem, geo.request_ring, geo.request_capacity)
            free = sorted(set(range(geo.slots)) - {s for s, _ in self.crafter.live}) or [0xFFFF]
            ring.try_push(self.crafter.frame(True, rng.choice((fr.ALLOC, fr.FREE, fr.REQUEST))),
                          rng.choice(free))
            return
        # Followed extents start at a multiple of UNIT with their progress word: a word there
        # holding a count no bigger than any body is one (payloads are random bytes). Only a
        # value a reader refuses is swapped in, by CAS: had a writer stored there meanwhile,
        # nothing is written.
        units = geo.heap_size // UNIT
        limit = geo.max_message_size
        for _ in range(64):
            at = geo.heap + rng.randrange(units) * UNIT
            word = self.mem.load(at, ACQUIRE)
            if 0 < word <= limit:
                bad = rng.choice((FOLLOW_ABORTED, limit + 8, rng.getrandbits(64) | (1 << 62),
                                  word - 8 if word > 8 else 0, 0))
                if self.mem.cas(at, word, bad, ACQ_REL) == word:
                    self._heap_writes += 1
                return

    def _owner(self) -> None:
        """The words issue 40 item 8 names: owner state and PID (region header), control state;
        never their right values (a case's garbage always needs repairing at the end)."""
        rng = self.rng
        at = rng.choice((_OWNER_STATE, _PID, CONTROL))
        if at == _PID:  # no process has these
            self.store(at, rng.choice((4_000_000, 1 << 31, (1 << 40) | rng.getrandbits(32))))
        else:  # states nobody writes, or those of a closed or starting owner
            self.store(at, rng.choice((0, 2, 3, 1 << 31, rng.getrandbits(64) | 4)))

    def _geometry(self) -> None:
        """Plausible but wrong geometry words (issue 40 item 9); never the right ones."""
        rng = self.rng
        at = rng.choice(_GEOMETRY)
        real = self._real[at]
        wrong = [v for v in (real + 1, real - 1, real * 2, real // 2, real + 4096, rng.getrandbits(64),
                             1 << rng.randrange(40), 0) if v != real]
        self.store(at, rng.choice(wrong))

    @property
    def heap_writes(self) -> int:
        """Progress words the heap fuzz changed."""
        return self._heap_writes


def _mpsc_free(tail: int, head: int, capacity: int) -> tuple[int, int] | None:
    """Positions of an MPSC ring free of records: producers claim (move the tail) before they
    write, so all past the tail is free; a margin leaves what they claim while we write alone."""
    start, end = tail + capacity // 4, head + capacity - capacity // 8
    return (start, end) if end - start >= 64 else None


def _spsc_free(tail: int, head: int, capacity: int) -> tuple[int, int] | None:
    """Positions of an SPSC ring its producer cannot be writing now. It writes its records
    (header first, committed) past the published tail and publishes them by moving the tail:
    anything up to half the ring past the tail (a record, or a batch, plus wrap padding), and,
    when it wraps, at the start of the buffer. (A garbage tail run ahead of the producer's
    therefore shows the consumer a record being written: the fuzz writes none.)"""
    reach = capacity // 2 + 16
    lap = (tail // capacity + 1) * capacity  # where it writes when it wraps
    end = head + capacity - 64
    spans = [(a, b) for a, b in ((tail + reach, min(lap, end)), (lap + reach, end)) if b - a >= 64]
    return spans[-1] if spans else None


def run(fuzzer: RegionFuzzer, ops: int, pace: float) -> float:
    """``ops`` bursts, ``pace`` seconds apart; the seconds it took."""
    t0 = time.monotonic()
    for _ in range(ops):
        fuzzer.op()
        time.sleep(pace)
    return time.monotonic() - t0
