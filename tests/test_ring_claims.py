"""MpscRing claim protocol: a producer held between its claim and its commit is never padded
while it is alive, and a producer whose claim was padded (judged dead) never commits.

Producers run in a thread and are held at exact points of ``try_push_parts`` (after the tail
CAS, or between header and copy), deterministically, while the consumer runs ``unblock``. The
hooks hold Python's reference of the push (``_try_push_parts_py``): the native twin runs the
same steps with the GIL held, so no thread can stop it between them; its callouts into the
slow paths are tested at the end with states set up before the push.
"""
from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

import pytest

import time

from cxlrpc.memory import RELEASE, AtomicMemory
from cxlrpc.ring import ClaimRevoked, MpscRing, base
from cxlrpc.ring.mpsc import NO_CLAIM
from cxlrpc.ring.record import COMMITTED, KIND_DATA, TAIL_OFFSET, make_header

from ring_env import Env as _Env, payload

pytestmark = pytest.mark.timeout(30)
LIVE, OTHER = 3, 4
TAG = 5


class Gate:
    """A point a producer thread stops at until the test opens it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def stop_here(self) -> None:
        self.reached.set()
        assert self.opened.wait(10), "the test never opened the gate"


class HeldAfterClaim:
    """Stands in for the ring's tail counter: a successful CAS (the claim) stops at the gate."""

    def __init__(self, real, gate: Gate) -> None:
        self.real, self.gate = real, gate

    def load(self, order):
        return self.real.load(order)

    def store(self, value, order):
        self.real.store(value, order)

    def cas(self, expected, desired, order):
        old = self.real.cas(expected, desired, order)
        if old == expected:
            self.gate.stop_here()
        return old


class HeldBeforeCopy(tuple):
    """Record parts whose second iteration (the copy, after the header is written) stops at the gate."""

    def __new__(cls, parts, gate: Gate):
        self = super().__new__(cls, parts)
        self.gate, self.iterations = gate, 0
        return self

    def __iter__(self):
        self.iterations += 1
        if self.iterations == 2:
            self.gate.stop_here()
        return super().__iter__()


class HeldCommit(tuple):
    """Record parts whose copy (second iteration) reports the gate, then waits: the copy of a
    producer frozen mid-payload.  The copy itself then lands after the consumer padded it."""

    def __new__(cls, ring: MpscRing, gate: Gate, parts):
        self = super().__new__(cls, parts)
        self.gate, self.iterations = gate, 0
        return self

    def __iter__(self):
        self.iterations += 1
        items = list(super().__iter__())
        if self.iterations == 2:
            yield items[0][:0]  # the copy loop starts ...
            self.gate.stop_here()  # ... and is frozen here
        yield from items


class Setup:
    """A ring plus one claim word per producer (as channel slots hold them)."""

    def __init__(self, cap: int = 4096, start: int = 0) -> None:
        self.env = _Env(MpscRing, cap, start)
        self.ring: MpscRing = self.env.ring
        self.words = mmap.mmap(-1, 4096)
        self.mem = AtomicMemory(self.words)
        self.claims = {p: self.mem.counter(p * 128) for p in (LIVE, OTHER)}
        for c in self.claims.values():
            c.store(NO_CLAIM, RELEASE)
        self.dead: set[int] = set()  # producers the consumer may treat as dead

    def producer_dead(self, producer: int, tag: int) -> bool:
        return producer in self.dead or tag != TAG

    def live_claims(self) -> list[int]:
        return [c.load(0) for p, c in self.claims.items() if p not in self.dead]

    def push_in_thread(self, parts, producer: int = LIVE,
                       revoked: Callable[[], bool] | None = None) -> tuple[threading.Thread, dict]:
        """``producer`` pushes ``parts`` in a thread; ``revoked()`` says what a channel's does
        (by default: its slot was reaped, i.e. it is in ``dead``)."""
        out: dict = {}
        if revoked is None:
            revoked = lambda: producer in self.dead  # noqa: E731

        def run() -> None:
            try:
                out["ok"] = self.ring._try_push_parts_py(parts, producer, TAG, self.claims[producer],
                                                         revoked)
            except ClaimRevoked as exc:
                out["revoked"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, out

    def unblock(self) -> bool:
        return self.ring.unblock(self.producer_dead, self.live_claims)


def assert_exact(s: Setup, records: list[bytes]) -> None:
    """A live producer's records, pushed as the ring makes room, all arrive whole and in order."""
    got = []
    for r in records:
        while not s.ring.try_push_parts((r,), OTHER, TAG, s.claims[OTHER]):
            got += s.ring.pop_batch()
    assert got + s.ring.pop_batch() == records


def push_held(s: Setup, held: str, gate: Gate, rec: bytes,
              revoked: Callable[[], bool] | None = None) -> tuple[threading.Thread, dict]:
    """LIVE pushes ``rec`` in a thread and is held at ``gate``: right after its claim
    ("after-claim"), before its copy ("before-copy") or inside its commit ("mid-copy");
    returns once it is held (the ring's own tail back in place)."""
    real = s.ring._tail
    if held == "after-claim":
        s.ring._tail = HeldAfterClaim(real, gate)
        parts = (rec,)
    elif held == "before-copy":
        parts = HeldBeforeCopy((rec,), gate)
    else:
        parts = HeldCommit(s.ring, gate, (rec,))
    t, out = s.push_in_thread(parts, revoked=revoked)
    assert gate.reached.wait(10)
    s.ring._tail = real
    return t, out


def assert_revoked_without_trace(s: Setup, gate: Gate, t: threading.Thread, out: dict) -> None:
    """After the consumer padded a held producer's claim: nothing is delivered, and the
    producer, let go, raises ClaimRevoked and leaves its free space zero."""
    assert s.ring.poll(lambda v: None) == 0  # the padding is consumed, nothing delivered
    assert not s.ring.readable()
    gate.opened.set()
    t.join(10)
    assert "revoked" in out and "ok" not in out, out
    data = s.env.buf[s.ring.data:s.ring.data + s.ring.capacity]
    assert not any(data), "the revoked producer left bytes in free space"


def test_live_producer_held_after_its_claim_is_never_padded():
    """Header still zero, producer alive: unblock() refuses however often it runs; the record then arrives."""
    s, gate = Setup(), Gate()
    real = s.ring._tail
    s.ring._tail = HeldAfterClaim(real, gate)
    rec = payload(1, 200)
    t, out = s.push_in_thread((rec,))
    assert gate.reached.wait(10)
    s.ring._tail = real
    assert s.ring.blocked_producer() == -1
    for _ in range(50):  # housekeeping runs again and again while the producer is held
        assert not s.unblock()
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.ring.pop() == rec
    assert s.ring.dropped == 0


def test_live_producer_held_between_header_and_commit_is_never_padded():
    s, gate = Setup(), Gate()
    rec = payload(2, 300)
    t, out = s.push_in_thread(HeldBeforeCopy((rec[:100], rec[100:]), gate))
    assert gate.reached.wait(10)
    assert s.ring.blocked_producer() == LIVE
    for _ in range(50):
        assert not s.unblock()
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.ring.pop() == rec


@pytest.mark.parametrize("held", ["after-claim", "before-copy"])
def test_padded_claim_is_revoked_and_never_committed(held):
    """The consumer judges the held producer dead and pads its claim; when the producer resumes
    it raises ClaimRevoked, commits nothing, and the ring goes on exactly (free space stays zero)."""
    s, gate = Setup(), Gate()
    rec = payload(3, 256)
    t, out = push_held(s, held, gate, rec)
    assert not s.unblock()  # alive: left alone
    if held == "before-copy":
        gate.opened.set()  # it copies and commits in the window: the record arrives whole
        t.join(10)
        assert out == {"ok": True} and s.ring.pop() == rec
        gate, rec = Gate(), payload(5, 256)
        t, out = s.push_in_thread(HeldCommit(s.ring, gate, (rec,)))
        assert gate.reached.wait(10)
    s.dead.add(LIVE)  # its slot was reaped: the consumer may pad it now
    assert s.unblock()
    assert_revoked_without_trace(s, gate, t, out)
    # the revoked producer left nothing behind: the next records of a live producer are exact
    s.dead.clear()
    assert_exact(s, [payload(10 + i, 100 + 37 * i) for i in range(40)])
    assert s.ring.dropped == 1


def test_gap_of_a_dead_claim_stops_at_the_next_live_claim():
    """A dead producer's zero-header claim is padded only up to where a live producer's claim starts."""
    s = Setup()
    dead_at = s.ring.head_position
    s.claims[OTHER].store(dead_at, RELEASE)  # OTHER claims 64 bytes and dies before writing
    assert s.ring._tail.cas(dead_at, dead_at + 64, 0) == dead_at
    s.dead.add(OTHER)
    gate = Gate()
    real = s.ring._tail
    s.ring._tail = HeldAfterClaim(real, gate)
    rec = payload(4, 40)
    t, out = s.push_in_thread((rec,))  # LIVE claims right behind it and is held
    assert gate.reached.wait(10)
    s.ring._tail = real
    assert s.unblock()  # pads the dead claim only
    assert s.ring.poll(lambda v: None) == 0
    assert s.ring.head_position == dead_at + 64 == s.claims[LIVE].load(0)
    assert not s.unblock()  # the live claim at the head is left alone
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.ring.pop() == rec


# ----------------------------------------------------------------------------- garbage and claims
def garbage_over_head(s: Setup) -> None:
    """A committed header at the head that no producer wrote: its length runs past the tail."""
    at = s.ring.data + (s.ring.head_position & s.ring.mask)
    s.env.mem.store(at, COMMITTED | (KIND_DATA << 48) | 0xFFFF, RELEASE)


def test_garbage_is_skipped_only_up_to_a_claim_still_being_written():
    """A corrupt record at the head is skipped up to the first live claim, not to the tail:
    freed, that claim's space would be claimed again a lap later, and its producer's late
    copy would land in that record (the wrong bytes delivered as someone else's)."""
    s = Setup()
    s.ring.live_claims = s.live_claims
    assert s.ring.try_push_parts((payload(1, 56),), OTHER, TAG, s.claims[OTHER])
    gate, rec = Gate(), payload(2, 56)
    t, out = s.push_in_thread(HeldBeforeCopy((rec,), gate))  # LIVE: header written, copy pending
    assert gate.reached.wait(10)
    claimed = s.claims[LIVE].load(0)
    assert claimed == 64
    garbage_over_head(s)
    assert s.ring.poll(lambda v: None) == 0
    assert s.ring.head_position == claimed  # the garbage is dropped, LIVE's claim kept
    assert s.ring.dropped == 1
    later, pushed = [payload(10 + i, 56) for i in range(200)], []
    for r in later:  # OTHER fills the ring: it cannot lap into LIVE's claim
        if not s.ring.try_push_parts((r,), OTHER, TAG, s.claims[OTHER]):
            break
        pushed.append(r)
    assert 0 < len(pushed) < len(later)
    assert s.ring.poll(lambda v: None) == 0  # LIVE's record is not committed yet
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.claims[LIVE].load(0) == NO_CLAIM
    assert s.ring.pop_batch() == [rec] + pushed  # every record whole, in order
    assert s.ring.dropped == 1


def test_hold_at_garbage_ends_when_a_claim_never_finishes(monkeypatch):
    """A live claim word that no write follows (garbage over the word, or a producer stalled
    mid-copy) holds the consumer at most HOLD_S; then it skips to the tail."""
    monkeypatch.setattr(base, "HOLD_S", 0.05)
    s = Setup()
    s.ring.live_claims = s.live_claims
    for i in range(3):
        assert s.ring.try_push_parts((payload(i, 56),), OTHER, TAG, s.claims[OTHER])
    s.claims[LIVE].store(0, RELEASE)  # a claim nobody writes, where the garbage lies
    garbage_over_head(s)
    t0 = time.monotonic()
    assert s.ring.poll(lambda v: None) == 0
    assert s.ring.head_position == 0 and s.ring.dropped == 0  # held at the garbage itself
    while s.ring.head_position == 0 and time.monotonic() < t0 + 5:
        assert s.ring.poll(lambda v: None) == 0
    assert time.monotonic() - t0 >= 0.05
    assert s.ring.head_position == s.env.load_counter(TAIL_OFFSET) == 192  # to the tail, once
    assert s.ring.dropped == 1 and not s.ring.readable()


def test_garbage_tail_resets_the_ring_once_live_claims_are_done():
    """A garbage tail clears the ring, but not while a live producer writes a claim in it."""
    s = Setup()
    s.ring.live_claims = s.live_claims
    gate, rec = Gate(), payload(3, 100)
    t, out = s.push_in_thread(HeldBeforeCopy((rec,), gate))
    assert gate.reached.wait(10)
    tail = s.env.load_counter(TAIL_OFFSET)
    s.env.store_counter(TAIL_OFFSET, tail + 3)  # misaligned: garbage
    assert s.ring.poll(lambda v: None) == 0
    assert s.ring.dropped == 0 and s.env.load_counter(TAIL_OFFSET) == tail + 3  # waits for LIVE
    assert s.env.mem.load(s.ring.data, 0) == make_header(100, KIND_DATA, LIVE, False, TAG)
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.ring.poll(lambda v: None) == 0  # now it resets: claims in flight are lost
    assert s.ring.dropped == 1 and s.env.load_counter(TAIL_OFFSET) == s.ring.head_position
    assert not any(s.env.buf[s.ring.data:s.ring.data + s.ring.capacity])
    assert_exact(s, [payload(20 + i, 90) for i in range(30)])


def test_unblock_pads_a_header_no_live_producer_writes():
    """An uncommitted header naming a live producer that is not writing there (garbage, or its
    commit was lost to garbage) is padded, so the ring never stays blocked by it."""
    s = Setup()
    at = s.ring.head_position
    s.claims[OTHER].store(at, RELEASE)
    assert s.ring._tail.cas(at, at + 64, 0) == at
    s.env.mem.store(s.ring.data, make_header(56, KIND_DATA, LIVE, False, TAG), RELEASE)
    assert s.ring.blocked_producer() == LIVE
    assert not s.unblock()  # OTHER's claim is at the head: someone may be writing there
    s.claims[OTHER].store(NO_CLAIM, RELEASE)
    assert s.unblock()  # LIVE is alive, but claims nothing: not its write
    assert s.ring.poll(lambda v: None) == 0 and not s.ring.readable()


def test_unblock_leaves_a_wrapped_record_of_a_live_claim_alone():
    """A record that did not fit before the end starts a lap after its claim: a live producer
    writing it there blocks unblock() at that lap start too."""
    cap = 4096
    s, gate = Setup(cap, start=cap - 64), Gate()
    rec = payload(6, 200)
    t, out = s.push_in_thread(HeldBeforeCopy((rec,), gate))  # claim at cap - 64, record at cap
    assert gate.reached.wait(10)
    assert s.claims[LIVE].load(0) == cap - 64
    assert s.ring.poll(lambda v: None) == 0  # the padding is consumed; the record is not committed
    assert s.ring.head_position == cap and s.ring.blocked_producer() == LIVE
    s.dead.add(OTHER)
    assert not s.unblock()
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True} and s.ring.pop() == rec


def test_hold_that_runs_out_passes_only_the_claim_it_waited_for(monkeypatch):
    """A claim at the garbage that never finishes is passed after HOLD_S; another live
    producer's claim further on still stops the consumer, and its record arrives whole."""
    monkeypatch.setattr(base, "HOLD_S", 0.05)
    s = Setup()
    s.ring.live_claims = s.live_claims
    assert s.ring.try_push_parts((payload(1, 56),), 9, TAG)  # a record at 0
    s.claims[LIVE].store(0, RELEASE)  # LIVE's word names it: stuck (or garbage over the word)
    gate, rec = Gate(), payload(2, 56)
    t, out = s.push_in_thread(HeldBeforeCopy((rec,), gate), OTHER)  # OTHER writes at 64
    assert gate.reached.wait(10)
    garbage_over_head(s)
    deadline = time.monotonic() + 5
    while s.ring.head_position == 0 and time.monotonic() < deadline:
        assert s.ring.poll(lambda v: None) == 0
    assert s.ring.head_position == 64 == s.claims[OTHER].load(0)
    pushed = []
    while s.ring.try_push_parts((payload(100 + len(pushed), 56),), 9, TAG):  # cannot lap into 64
        pushed.append(payload(100 + len(pushed), 56))
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.ring.pop_batch() == [rec] + pushed


def test_garbage_tail_behind_the_head_waits_for_a_claim_made_from_it():
    """A producer whose cached head allows it claims at a garbage tail behind the head: the
    reset waits for that claim too (it lies outside the lap ahead of the head)."""
    cap = 4096
    s = Setup(cap, start=4160)
    s.ring.live_claims = s.live_claims
    producer = MpscRing(s.env.buf, s.env.mem, s.ring.data - 256, cap)  # LIVE's own view
    producer._head_cache = 3904  # an older, valid view of the head
    s.env.store_counter(TAIL_OFFSET, 4000)  # garbage: aligned, behind the head
    gate, rec, out = Gate(), payload(7, 56), {}

    def run() -> None:
        out["ok"] = producer._try_push_parts_py(HeldBeforeCopy((rec,), gate), LIVE, TAG, s.claims[LIVE],
                                                lambda: False)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert gate.reached.wait(10)
    assert s.claims[LIVE].load(0) == 4000
    for _ in range(3):
        assert s.ring.poll(lambda v: None) == 0
    assert s.ring.dropped == 0 and s.env.load_counter(TAIL_OFFSET) == 4064  # not reset under LIVE
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.ring.poll(lambda v: None) == 0  # now it is
    assert s.ring.dropped == 1 and s.env.load_counter(TAIL_OFFSET) == s.ring.head_position == 4160
    assert not any(s.env.buf[s.ring.data:s.ring.data + cap])
    assert_exact(s, [payload(20 + i, 56) for i in range(100)])


@pytest.mark.parametrize("word", [68, 1 << 62, (1 << 64) - 8])
def test_claim_words_that_are_no_positions_are_ignored(word):
    """Garbage over a claim word (misaligned, past COUNTER_LIMIT) is no position to stop at."""
    s = Setup()
    s.ring.live_claims = s.live_claims
    for i in range(3):
        assert s.ring.try_push_parts((payload(i, 56),), 9, TAG)
    s.claims[LIVE].store(word, RELEASE)
    garbage_over_head(s)
    assert s.ring.poll(lambda v: None) == 0
    assert s.ring.head_position == 192 and s.ring.dropped == 1 and not s.ring.readable()


def test_a_finished_push_leaves_a_new_holders_claim_word_alone():
    """The claim word is cleared after the commit by a CAS from the claim: a producer that
    finishes after its slot went to a new holder (who wrote the word) leaves it as it is."""
    s, gate = Setup(), Gate()
    rec = payload(8, 56)
    t, out = s.push_in_thread(HeldBeforeCopy((rec,), gate))
    assert gate.reached.wait(10)
    s.claims[LIVE].store(4096, RELEASE)  # the slot's new holder claims
    gate.opened.set()
    t.join(10)
    assert out == {"ok": True}
    assert s.claims[LIVE].load(0) == 4096
    assert s.ring.pop() == rec


@pytest.mark.parametrize("payload_word", [0, make_header(8, KIND_DATA, LIVE, False, TAG)])
def test_a_claim_reached_through_garbage_is_waited_for_at_most_the_hold(monkeypatch, payload_word):
    """Garbage over an idle client's claim word names the middle of a record; the consumer,
    skipping garbage, stops there and reads payload as an uncommitted header: unblock() pads it
    once HOLD_S passed (it refused for as long as the word stayed)."""
    monkeypatch.setattr(base, "HOLD_S", 0.05)
    s = Setup()
    s.ring.live_claims = s.live_claims
    for i in range(3):
        assert s.ring.try_push_parts((bytes(8) + payload_word.to_bytes(8, "little") + bytes(40),), OTHER, TAG,
                                     s.claims[OTHER])
    s.claims[LIVE].store(80, RELEASE)  # inside the record at 64 (its second payload word)
    garbage_over_head(s)
    assert s.ring.poll(lambda v: None) == 0 and s.ring.head_position == 80
    assert not s.unblock()  # it may be a live producer's: waited for
    deadline = time.monotonic() + 5
    while s.ring.readable() and time.monotonic() < deadline:
        s.ring.poll(lambda v: None)
        s.unblock()
    assert not s.ring.readable() and s.ring.head_position == 192


def test_a_claim_word_another_holder_wrote_is_left_to_it():
    """A producer finds its claim word holding what it did not write: judged dead (the slot's
    new holder wrote it), it raises ClaimRevoked before claiming anything and leaves the word;
    alive (garbage over the word), it writes its claim over it and pushes."""
    s = Setup()
    s.claims[LIVE].store(4096, RELEASE)  # the new holder's claim
    tail = s.env.load_counter(TAIL_OFFSET)
    with pytest.raises(ClaimRevoked):
        s.ring.try_push_parts((payload(1, 40),), LIVE, TAG, s.claims[LIVE], lambda: True)
    assert s.claims[LIVE].load(0) == 4096 and s.env.load_counter(TAIL_OFFSET) == tail
    s.claims[LIVE].store(12345, RELEASE)  # garbage over an idle producer's word
    assert s.ring.try_push_parts((payload(2, 40),), LIVE, TAG, s.claims[LIVE], lambda: False)
    assert s.claims[LIVE].load(0) == NO_CLAIM
    assert s.ring.pop_batch() == [payload(2, 40)]
