"""Many-producer single-consumer ring (Agrona ManyToOneRingBuffer style).

A producer claims space with a CAS on the tail, writes an uncommitted header carrying its
producer id, copies the payload, then release-stores the committed header.  The consumer
stops at an uncommitted record and zeroes what it consumes, so every header a producer
has not yet written reads as zero.  A record whose producer died between claim and commit
is turned into padding by ``MpscRing.unblock`` once the caller proves the producer dead,
so one crash never stalls the ring and a slow producer never loses a record it goes on to
commit.  A claim of a live producer that makes no progress for a bound the caller gives (garbage
over its claim word, most likely) is taken back and padded too, so one word never stalls it.
"""
from __future__ import annotations

import time
from typing import Callable, Collection, Sequence

from ..memory import ACQ_REL, ACQUIRE, RELEASE, BytesLike, Counter
from .base import COUNTER_LIMIT, RingBase, _native
from .record import (
    COMMITTED,
    HEADER_SIZE,
    KIND_DATA,
    KIND_PADDING,
    LENGTH_MASK,
    MAX_PRODUCER_ID,
    PAD_CLEAN,
    TAG_MASK,
    TAG_SHIFT,
    header_producer,
    header_tag,
)


class ClaimRevoked(RuntimeError):
    """The consumer turned this producer's claim into padding (it judged the producer dead):
    nothing was committed, and the producer must stop using the ring under that identity."""


#: A claim word holding no position (positions stay below 2**62).
NO_CLAIM = 1 << 63


class MpscRing(RingBase):
    """Many producers (each with an id below 65536), one consumer.

    Producers that want a stalled claim of theirs never to be mistaken for a dead one pass a
    ``claim`` counter of their own (one writer: them): it holds the tail they are claiming
    at from before the claim until after the commit (NO_CLAIM otherwise), so the consumer
    can tell a live claimant whose header is not written yet, and never frees space a live
    producer is still writing when it skips garbage (``live_claims``).  Headers
    are written and committed by CAS from the value the producer expects, so a producer
    whose claim the consumer already padded learns it (``ClaimRevoked``) and never
    commits into space that was reclaimed.

    A consumer that pads a live producer's claim (``unblock`` with ``stall``) first takes
    it back (the claim word is set to NO_CLAIM), and ``revoked()`` must say True once it is:
    a producer that resumes then either finds its header CAS or its commit CAS failing (its
    exact header word is nowhere else: the producer id is its own), or finds the head past
    its claim after writing its header into free space, and in each case learns it was
    revoked, undoes its header or clears its bytes, and raises ClaimRevoked.  What remains is
    a producer frozen inside its payload copy for the whole stall bound while its heartbeat
    goes on: the rest of its copy lands in freed space (cleared again when it resumes unless
    the ring came close to a lap meanwhile).
    """

    _multi_producer = True

    def try_push(self, data: bytes | memoryview, producer: int = 0) -> bool:
        """Append one record; False when the ring is full (backpressure, nothing written)."""
        return self.try_push_parts((data,), producer)

    def _try_push_parts_py(self, parts: Sequence[BytesLike], producer: int = 0, tag: int = 0,
                           claim: Counter | None = None,
                           revoked: Callable[[], bool] | None = None) -> bool:
        """Claim, fill and commit one record made of ``parts`` concatenated.

        False when the ring is full.  ``revoked()`` (asked only when a header CAS fails or the
        head passed the claim) tells whether the consumer may have judged this producer dead;
        then ``ClaimRevoked`` is raised and nothing is committed.  Otherwise the failure
        is garbage over the ring, and the record is written like any other.
        """
        if not 0 <= producer <= MAX_PRODUCER_ID or not 0 <= tag <= TAG_MASK:
            raise ValueError("producer id must fit in 16 bits and tag in 6")
        length = 0
        for p in parts:
            length += len(p)
        if length > self.max_payload:
            raise ValueError(f"record of {length} bytes exceeds the ring's limit {self.max_payload}")
        cap, mask = self.capacity, self.mask
        size = HEADER_SIZE + ((length + 7) & ~7)
        tail_ctr = self._tail
        mine = NO_CLAIM  # what our claim word holds, as we left it
        while True:
            tail = tail_ctr.load(ACQUIRE)
            if tail & 7 or tail >= COUNTER_LIMIT:
                return self._give_up(claim, mine)  # garbage tail: the consumer resets it
            idx = tail & mask
            to_end = cap - idx
            need = size if size <= to_end and not self._early_wrap(tail, idx, size) else to_end + size
            if tail + need - self._head_cache > cap or self._head_cache > tail:
                head = self._head.load(ACQUIRE)
                if not self.valid_head(head, tail):
                    return self._give_up(claim, mine)  # garbage head: the consumer republishes its own
                self._head_cache = head
                if tail + need - head > cap:
                    return self._give_up(claim, mine)
            if claim is not None:  # visible before the claim below is
                if claim.cas(mine, tail, ACQ_REL) != mine:
                    self._claim_moved(claim, tail, revoked)
                mine = tail
            if tail_ctr.cas(tail, tail + need, ACQ_REL) == tail:
                break
        data = self.data
        word = (tag << TAG_SHIFT) | (KIND_DATA << 48) | (producer << 32) | length
        cas = self.mem.cas
        if need != size:
            # Our record goes to the start: its uncommitted header goes first, so the whole
            # claim is attributable to us before the padding makes it reachable.
            written = [(data, tail + to_end, word)]
            if cas(data, 0, word, ACQ_REL) != 0:
                self._open(written, revoked)
            pad = COMMITTED | PAD_CLEAN | (KIND_PADDING << 48) | (producer << 32) | (to_end - HEADER_SIZE)
            written.append((data + idx, tail, pad))
            if cas(data + idx, 0, pad, ACQ_REL) != 0:
                self._open(written, revoked)
            idx = 0
        else:
            written = None
            if cas(data + idx, 0, word, ACQ_REL) != 0:
                self._open([(data + idx, tail, word)], revoked)
        # The consumer passes a claim only by padding it (it judged us dead): then our header
        # went into free space, and nothing may be copied or committed there.
        if revoked is not None and self._head.load(ACQUIRE) > tail and revoked():
            self._revoke(written or [(data + idx, tail, word)],
                         "the consumer passed this claim before its header was written")
        start = data + idx + HEADER_SIZE
        buf = self.buf
        for p in parts:
            n = len(p)
            buf[start:start + n] = p
            start += n
        if cas(data + idx, word, word | COMMITTED, ACQ_REL) != word and revoked is not None and revoked():
            self._lost_commit(idx, tail, need, size)
        if claim is not None:  # done: nothing more of ours lands at that claim (a CAS: should
            claim.cas(tail, NO_CLAIM, ACQ_REL)  # the slot have a new holder, its word is not ours)
        return True

    #: ``try_push_parts(parts, producer=0, tag=0, claim=None, revoked=None)``: the native twin
    #: of the method above where it is built.
    try_push_parts = _native.RingCore._push_mpsc if _native is not None else _try_push_parts_py

    def _lost_commit(self, idx: int, tail: int, need: int, size: int) -> None:
        """Our claim was padded and consumed while we copied: our bytes lie in free space.
        Clear them unless the tail came close enough to a lap that someone may claim them
        anew, then raise ClaimRevoked."""
        if self._tail.load(ACQUIRE) + self.capacity // 2 <= tail + need - size + self.capacity:
            self.mem.zero(self.data + idx + HEADER_SIZE, size - HEADER_SIZE)
        raise ClaimRevoked("the consumer reclaimed this claim before it was committed")

    def _open(self, written: list[tuple[int, int, int]], revoked: Callable[[], bool] | None) -> None:
        """Slow path of a header CAS that found something other than zero: garbage over free
        space (overwritten), or the consumer's padding because it judged us dead (then, if
        ``revoked()`` agrees, ``ClaimRevoked``)."""
        addr, _, value = written[-1]
        load, cas = self.mem.load, self.mem.cas
        for _ in range(4):
            observed = load(addr, ACQUIRE)
            if observed and revoked is not None and revoked():
                self._revoke(written[:-1], "the consumer reclaimed this claim before its header was written")
            if cas(addr, observed, value, ACQ_REL) == observed:
                return
        # garbage keeps landing here: give up on this header, like any record garbage hits

    def _revoke(self, written: list[tuple[int, int, int]], why: str) -> None:
        """Undo the headers we wrote where the consumer already passed (free space must read
        zero), then raise ``ClaimRevoked``."""
        head = self._head.load(ACQUIRE)
        for addr, pos, value in written:
            if pos < head:
                self.mem.cas(addr, value, 0, ACQ_REL)
        raise ClaimRevoked(why)

    @staticmethod
    def _give_up(claim: Counter | None, mine: int) -> bool:
        if claim is not None:  # a claim we lost must not look like ours (unless the word is
            claim.cas(mine, NO_CLAIM, ACQ_REL)  # no longer ours: the slot has another holder)
        return False

    @staticmethod
    def _claim_moved(claim: Counter, value: int, revoked: Callable[[], bool] | None) -> None:
        """Our claim word no longer holds what we wrote last: the slot's new holder wrote it
        (the consumer judged us dead: ClaimRevoked, nothing claimed yet), or garbage did
        (overwritten with ``value``)."""
        if revoked is not None and revoked():
            raise ClaimRevoked("this slot has another holder: its claim word is not ours")
        claim.store(value, RELEASE)

    @property
    def head_position(self) -> int:
        """Consumer only: where the next record starts (monotonic)."""
        return self._head_local

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

    #: (head, header word, claims at the head) the head was last found blocked at, and since when
    _stall: tuple[tuple[int, int, tuple[int, ...]], float] | None = None

    def _passable(self, head: int, word: int, at: list[int], stall: float | None) -> bool:
        """May the consumer pass the live claims ``at`` the head?  One it reached by skipping
        garbage after HOLD_S; any once the head stood blocked, unchanged, for ``stall`` s."""
        if head == self._jumped_to and not self._waiting("claim", head):
            return True
        if stall is None:
            return False
        key, now = (head, word, tuple(sorted(at))), time.monotonic()
        if self._stall is None or self._stall[0] != key:
            self._stall = (key, now)
            return False
        return now - self._stall[1] >= stall

    def unblock(self, producer_dead: Callable[[int, int], bool],
                live_claims: Callable[[], Collection[int]] | None = None,
                stall: float | None = None,
                revoke: Callable[[Collection[int]], None] | None = None) -> bool:
        """Consumer only: turn a dead producer's uncommitted record at the head into padding.

        Without ``live_claims``, ``producer_dead(id, tag)`` tells whether the producer that
        wrote the header is gone.  With it (the claim words of the producers still alive,
        read after the tail; every producer must publish one), the record is padded when no
        live producer may be writing at the head (see ``writing_at``): the header is then
        a dead producer's or garbage, and a header still zero (claimed, nothing written yet)
        is cleared too.  A claim the consumer reached by skipping garbage (it may be garbage
        over the claim word, naming the middle of a record) is waited for HOLD_S at most,
        and any other for ``stall`` seconds (None: for ever) in which neither the head, its
        header word nor the claims there changed: a live producer makes progress within a
        moment, so that is garbage over a claim word (or a producer stalled as long as its
        heartbeat's timeout; its claim is taken back first, through ``revoke(positions)``, so
        that one raises ClaimRevoked instead of committing, see the class docstring).
        The padding ends at the next live producer's record start, the tail, or the end of
        the buffer, and a zero header's at the next written header.  It is written by CAS,
        so a producer writing at that moment wins or learns it lost.  Returns True if it
        unblocked.
        """
        head = self._head_local
        tail = self._tail.load(ACQUIRE)
        if tail <= head or tail - head > self.capacity or tail & 7:
            return False
        idx = head & self.mask
        word = self.mem.load(self.data + idx, ACQUIRE)
        if word & COMMITTED:
            return False
        limit = min(self.capacity - idx, tail - head)
        if live_claims is not None:
            claims = self._claims(live_claims)
            writing = self.writing_at(claims)
            if head in writing:
                at = [c for c in claims if head in self.writing_at((c,))]
                if not self._passable(head, word, at, stall):
                    return False  # a live producer may be writing there
                if revoke is not None:
                    revoke(at)
            later = [w - head for w in writing if head < w < head + limit]
            if later:
                limit = min(later)
        elif not word or not producer_dead(header_producer(word), header_tag(word)):
            return False
        if word:
            size = min(HEADER_SIZE + (((word & LENGTH_MASK) + 7) & ~7), limit)
        else:
            size = HEADER_SIZE
            load = self.mem.load
            while size < limit and load(self.data + idx + size, ACQUIRE) == 0:
                size += HEADER_SIZE
        pad = COMMITTED | (KIND_PADDING << 48) | (size - HEADER_SIZE)
        if self.mem.cas(self.data + idx, word, pad, ACQ_REL) != word:
            return False  # the producer wrote (or committed) meanwhile: look again later
        self.dropped += 1
        return True
