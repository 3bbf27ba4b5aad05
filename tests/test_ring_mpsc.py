"""MpscRing: model-checked push/pop sequences, three producer processes over POSIX shm,
dead-producer unblocking, and garbage.

In-process tests run the ring over an anonymous mmap with guard bytes on both sides; a
``collections.deque`` model plus the model's own head/tail byte counters predicts every
result (including exactly when ``try_push`` must report backpressure).
"""
from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import random
import time
import zlib

import posix_ipc
import pytest
from hypothesis import HealthCheck, event, assume, example, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cxlrpc.memory import ACQ_REL, RELEASE, AtomicMemory
from cxlrpc.ring import MpscRing, max_payload, ring_size
from cxlrpc.ring.record import (
    HEAD_OFFSET,
    KIND_DATA,
    KIND_PADDING,
    MAX_PRODUCER_ID,
    PAD_CLEAN,
    TAIL_OFFSET,
    hot_span,
    make_header,
)

from ring_env import (CAPACITIES, aligned_counter, apply_data_garbage, checked_poll, data_garbage, far_from,
                      make_record, resolve, TAG, GUARD, Env as _Env, Model, payload, rec_size, sizes)


def Env(cap: int, start: int = 0) -> _Env:
    return _Env(MpscRing, cap, start)

producers = st.one_of(st.sampled_from([0, 1, MAX_PRODUCER_ID]), st.integers(0, MAX_PRODUCER_ID))


# ----------------------------------------------------------------------------- model test
class MpscMachine(RuleBasedStateMachine):
    """Random push/push_parts (many producer ids)/pop/pop_batch/poll against a deque model."""

    @initialize(
        cap=st.sampled_from(CAPACITIES),
        start=st.one_of(st.just(0), st.integers(0, 1 << 50).map(lambda x: x * 8)),
    )
    def setup(self, cap: int, start: int) -> None:
        self.env = Env(cap, start)
        self.ring = self.env.ring
        self.model = Model(cap, start)
        self.maxp = max_payload(cap)

    def _new(self, n: int) -> bytes:
        return payload(next(self.model.uid), n)

    @rule(data=st.data(), producer=producers)
    def push(self, data, producer: int) -> None:
        rec = self._new(data.draw(sizes(self.maxp)))
        expect = self.model.fits(self.model.tail, len(rec))
        assert self.ring.try_push(rec, producer) is expect
        if expect:
            self.model.push(rec)

    @rule(data=st.data(), producer=producers)
    def push_parts(self, data, producer: int) -> None:
        total = data.draw(sizes(self.maxp))
        cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=4)))
        rec = self._new(total)
        parts = [rec[a:b] for a, b in zip([0] + cuts, cuts + [total])]
        if data.draw(st.booleans()):
            parts = [memoryview(p) for p in parts]
        expect = self.model.fits(self.model.tail, total)
        assert self.ring.try_push_parts(parts, producer) is expect
        if expect:
            self.model.push(rec)

    @rule(data=st.data(), parts=st.booleans())
    def push_oversize(self, data, parts: bool) -> None:
        n = data.draw(st.one_of(st.integers(self.maxp + 1, self.maxp + 16),
                                st.integers(self.maxp + 1, 4 * self.env.cap)))
        rec = self._new(n)
        free = self.ring.free_space()
        with pytest.raises(ValueError):
            if parts:
                self.ring.try_push_parts([rec[:3], rec[3:]], 5)
            else:
                self.ring.try_push(rec, 5)
        assert self.ring.free_space() == free  # nothing claimed

    @rule(producer=st.sampled_from([-1, MAX_PRODUCER_ID + 1, 1 << 20]))
    def push_bad_producer(self, producer: int) -> None:
        free = self.ring.free_space()
        with pytest.raises(ValueError):
            self.ring.try_push(b"abc", producer)
        assert self.ring.free_space() == free

    @rule()
    def pop(self) -> None:
        assert self.ring.pop() == self.model.pop()

    @rule(limit=st.one_of(st.none(), st.integers(0, 10)))
    def pop_batch(self, limit) -> None:
        got = self.ring.pop_batch() if limit is None else self.ring.pop_batch(limit)
        n = len(self.model.q) if limit is None else min(limit, len(self.model.q))
        assert got == [self.model.pop() for _ in range(n)]

    @rule(limit=st.integers(1, 12))
    def poll(self, limit: int) -> None:
        seen: list[bytes] = []

        def handler(view: memoryview) -> None:
            assert isinstance(view, memoryview) and self.env.view_in_bounds(view)
            seen.append(bytes(view))

        n = self.ring.poll(handler, limit)
        assert n == len(seen)
        assert seen == [self.model.pop() for _ in range(min(limit, len(self.model.q)))]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "env"):
            return
        m = self.model
        assert self.ring.free_space() == m.cap - (m.tail - m.head)
        assert self.ring.readable() == bool(m.q)
        assert self.ring.blocked_producer() is None  # every claim here is committed at once
        assert self.ring.dropped == 0
        assert self.env.guards_intact()


MpscMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestMpscModel = MpscMachine.TestCase
TestMpscModel.__doc__ = "Random operation sequences: no record lost, duplicated, reordered or corrupted; exact backpressure."


# ----------------------------------------------------------------------------- targeted
@pytest.mark.parametrize("cap", CAPACITIES)
def test_max_payload_fits_empty_ring_at_every_position(cap: int) -> None:
    """An empty ring accepts a max_payload record wherever its tail stands (wrap included)."""
    env = Env(cap)
    ring = env.ring
    big = payload(7, ring.max_payload)
    for pos in range(3 * cap, 4 * cap, 8):  # (an early wrap would take the tail back to the start)
        env.store_counter(TAIL_OFFSET, pos)
        env.store_counter(HEAD_OFFSET, pos)
        ring.attach()
        assert ring.try_push(big, 3)
        assert ring.pop() == big
        assert not any(env.buf[env.data:env.data + cap])  # consumed space reads zero
    assert env.guards_intact()


def test_request_response_traffic_keeps_to_the_hot_span() -> None:
    """Records pushed one at a time into an empty ring stay within its first hot_span bytes
    (plus one record), and the data area reads zero after each is consumed."""
    cap = 1 << 16
    env = Env(cap)
    ring = env.ring
    span = hot_span(cap)
    recs = [payload(i, n) for i, n in enumerate([4000, 100, 0, 9000, 4000, 16000, 50] * 20)]
    for i, rec in enumerate(recs):
        assert ring.try_push(rec, i % 3)
        end = env.load_counter(TAIL_OFFSET) % cap
        assert 0 < end <= span + rec_size(len(rec)) + rec_size(16000)
        assert ring.pop() == rec
        assert not any(env.buf[env.data:env.data + cap])
    assert env.load_counter(TAIL_OFFSET) > cap  # it wrapped, early, over and over
    assert env.guards_intact()


def test_consumer_clears_all_it_passes_but_a_clean_wraps_body() -> None:
    """The body of a producer's wrap padding (PAD_CLEAN, ending the buffer) is free space it
    never wrote: the consumer leaves it as it is (pages untouched). Every other record it
    passes reads zero after: data, a padding without the flag (a dead producer's claim, which
    may hold its bytes), and a flagged one that does not end the buffer (garbage)."""
    cap = 1 << 16
    env = Env(cap)
    ring = env.ring
    mark = env.data + cap - 64
    env.buf[mark] = 0x5A  # stands for bytes nobody clears (no one reads them either)
    assert ring.try_push(payload(1, hot_span(cap)), 1) and ring.pop() is not None
    assert ring.try_push(b"wrapped", 2)  # empty and past the span: wraps early
    assert env.load_counter(TAIL_OFFSET) == cap + rec_size(7)
    assert ring.pop() == b"wrapped"
    assert env.buf[mark] == 0x5A
    env.buf[mark] = 0
    assert not any(env.buf[env.data:env.data + cap])
    for word in (make_header(200, KIND_PADDING, 5, committed=True),
                 make_header(200, KIND_PADDING, 5, committed=True) | PAD_CLEAN):
        at = env.load_counter(TAIL_OFFSET)
        idx = env.data + at % cap
        env.buf[idx + 8:idx + 208] = b"\xee" * 200  # what the padding hides
        env.mem.store(idx, word, RELEASE)
        env.store_counter(TAIL_OFFSET, at + 208)
        assert ring.try_push(b"after", 3)
        assert ring.pop() == b"after"
        assert not any(env.buf[env.data:env.data + cap])


def test_a_wrap_at_the_head_is_freed_before_the_records_after_it() -> None:
    """An early wrap leaves most of the ring behind its padding: the consumer frees the padding
    as soon as it reaches it, before it hands over the records after it, so the other producers
    see that room at once instead of a ring that looks full while those are handled."""
    cap = 1 << 16
    env = Env(cap)
    ring = env.ring
    assert ring.try_push(payload(1, hot_span(cap)), 1) and ring.pop() is not None
    lap = (env.load_counter(TAIL_OFFSET) | (cap - 1)) + 1
    assert ring.try_push(b"first", 2) and ring.try_push(b"second", 3)  # (the first wraps early)
    seen = []

    def handler(view: memoryview) -> None:
        seen.append((bytes(view), env.load_counter(HEAD_OFFSET), ring.free_space()))

    assert ring.poll(handler) == 2
    assert seen == [(b"first", lap, cap - rec_size(5) - rec_size(6)),
                    (b"second", lap, cap - rec_size(5) - rec_size(6))]


def test_full_ring_rejects_and_stays_intact() -> None:
    """try_push on a full ring returns False and writes nothing: later pops are unaffected."""
    env = Env(1024)
    ring = env.ring
    recs = [payload(i, 100) for i in range(100)]
    pushed = list(itertools.takewhile(lambda r: ring.try_push(r, 9), recs))
    assert 0 < len(pushed) < len(recs)
    before = bytes(env.buf)
    assert not ring.try_push(payload(555, ring.max_payload), 1)
    assert not ring.try_push_parts([b"x" * 250, b"y" * 250], 2)
    assert bytes(env.buf) == before  # not a byte changed
    assert ring.pop_batch() == pushed


def test_oversize_and_bad_producer_raise_value_error() -> None:
    """Payloads above max_payload, or producer ids beyond 16 bits, raise ValueError and change nothing."""
    env = Env(2048)
    ring = env.ring
    assert ring.try_push(b"first")
    before = bytes(env.buf)
    for n in (ring.max_payload + 1, ring.max_payload + 8, 2048, 1 << 20):
        with pytest.raises(ValueError):
            ring.try_push(bytes(n))
        with pytest.raises(ValueError):
            ring.try_push_parts([bytes(n - 1), b"z"], 7)
    for p in (-1, MAX_PRODUCER_ID + 1):
        with pytest.raises(ValueError):
            ring.try_push(b"ok", p)
    assert bytes(env.buf) == before
    assert ring.try_push(bytes(ring.max_payload), MAX_PRODUCER_ID)
    assert ring.pop_batch() == [b"first", bytes(ring.max_payload)]
    assert env.guards_intact()


# ----------------------------------------------------------------------------- cross-process
SHM_COUNTER = itertools.count()
N_PRODUCERS = 3
N_RECORDS = 1500
XP_CAP = 4096


def mpsc_producer(shm_name: str, pid: int, count: int, seed: int, timeout: float) -> None:
    """Child process: push ``count`` tagged records as producer ``pid``, spinning (with a deadline) when full."""
    shm = posix_ipc.SharedMemory(shm_name)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    ring = MpscRing(memoryview(mm), AtomicMemory(mm), 0, XP_CAP)
    rng = random.Random(seed)
    deadline = time.monotonic() + timeout
    for seq in range(count):
        rec = make_record(rng, pid, seq, ring.max_payload)
        spins = 0
        while not ring.try_push(rec, pid + 100):
            spins += 1
            if spins & 63 == 0:
                if time.monotonic() > deadline:
                    os._exit(3)
                time.sleep(0)
    os._exit(0)


@pytest.fixture
def shm_segment():
    """A fresh POSIX shm segment (unique name), always unlinked afterwards."""
    made: list[posix_ipc.SharedMemory] = []

    def create(size: int) -> tuple[str, mmap.mmap]:
        name = f"/cxlrpc-test-{os.getpid()}-mpsc-{next(SHM_COUNTER)}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        made.append(shm)
        mm = mmap.mmap(shm.fd, size)
        shm.close_fd()
        return name, mm

    try:
        yield create
    finally:
        for shm in made:
            try:
                shm.unlink()
            except posix_ipc.ExistentialError:
                pass
        for shm in made:
            assert not os.path.exists("/dev/shm" + shm.name)


def test_cross_process_mpsc_delivery(shm_segment) -> None:
    """Three producer processes: per producer, records arrive in order, exactly once, checksums intact."""
    name, mm = shm_segment(ring_size(XP_CAP))
    buf, mem = memoryview(mm), AtomicMemory(mm)
    ring = MpscRing(buf, mem, 0, XP_CAP)
    ring.reset()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=mpsc_producer, args=(name, p, N_RECORDS, 1000 + p, 40.0), daemon=True)
             for p in range(N_PRODUCERS)]
    next_seq = {p: 0 for p in range(N_PRODUCERS)}
    errors: list[str] = []

    def handler(view: memoryview) -> None:
        if len(view) < TAG.size or len(view) > ring.max_payload:
            errors.append(f"bad record length {len(view)}")
            return
        pid, seq, crc = TAG.unpack_from(view)
        if pid not in next_seq:
            errors.append(f"unknown producer {pid}")
            return
        if seq != next_seq[pid]:
            errors.append(f"producer {pid}: got seq {seq}, expected {next_seq[pid]}")
        if zlib.crc32(view[TAG.size:]) != crc:
            errors.append(f"producer {pid} seq {seq}: checksum mismatch")
        next_seq[pid] = seq + 1

    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 40.0
        total, got, idle = N_PRODUCERS * N_RECORDS, 0, 0
        while got < total:
            n = ring.poll(handler)
            got += n
            assert not errors, errors[:5]
            if n == 0:
                idle += 1
                if idle & 255 == 0:
                    assert time.monotonic() < deadline, f"timed out with {got}/{total} records"
                    bad = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    assert not bad, f"producer exited with {bad}"
                    time.sleep(0)
        assert next_seq == {p: N_RECORDS for p in range(N_PRODUCERS)}
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
        assert not ring.readable()
        assert ring.dropped == 0
        assert ring.blocked_producer() is None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(2)
                if p.is_alive():
                    p.kill()
                    p.join(2)
        del ring
        mem.close()
        buf.release()
        mm.close()


# ----------------------------------------------------------------------------- dead producer
DEAD, LIVE = 77, 5


def advance(env: Env, slots: int) -> None:
    """Move head and tail on by ``slots`` 8-byte slots (empty records pushed and popped)."""
    for _ in range(slots):
        assert env.ring.try_push(b"", LIVE)
        assert env.ring.pop() == b""


def dead_claim(env: Env, length: int, mode: str) -> bool:
    """Claim space for a ``length`` record as a producer that then dies.

    mode: "zero" -- died right after the claim (header still zero);
          "hdr"  -- wrote its uncommitted header (at the start of the buffer if the claim wraps);
          "hdr+pad" -- like "hdr", and also wrote the wrap padding (same as "hdr" if no wrap).
    Returns whether the claim wrapped.
    """
    cap, mem = env.cap, env.mem
    tail = env.load_counter(TAIL_OFFSET)
    size = rec_size(length)
    idx = tail % cap
    to_end = cap - idx
    need = size if size <= to_end else to_end + size
    assert tail + need - env.load_counter(HEAD_OFFSET) <= cap
    assert mem.cas(GUARD + TAIL_OFFSET, tail, tail + need, ACQ_REL) == tail  # the claim
    wraps = need != size
    if mode != "zero":
        at = env.data + (0 if wraps else idx)
        mem.store(at, make_header(length, KIND_DATA, DEAD, committed=False), RELEASE)
        if wraps and mode == "hdr+pad":
            mem.store(env.data + idx, make_header(to_end - 8, KIND_PADDING, DEAD, committed=True), RELEASE)
    return wraps


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@example(cap=1024, slots=0, before=[], length=0, mode="zero", after=[8])
@example(cap=1024, slots=120, before=[], length=100, mode="zero", after=[8, 0])  # claim wraps
@example(cap=1024, slots=120, before=[], length=100, mode="hdr", after=[8])
@example(cap=1024, slots=120, before=[], length=100, mode="hdr+pad", after=[8])
@example(cap=1024, slots=18, before=[281, 281, 281], length=0, mode="zero", after=[])  # overfull before
@given(
    cap=st.sampled_from([1024, 2048]),
    slots=st.integers(0, 255),
    before=st.lists(st.integers(0, 300), max_size=3),
    length=st.integers(0, 504),
    mode=st.sampled_from(["zero", "hdr", "hdr+pad"]),
    after=st.lists(st.integers(0, 300), max_size=4),
)
def test_dead_producer_unblock(cap, slots, before, length, mode, after) -> None:
    """A claim whose producer died blocks the consumer until unblock(); later records then all arrive intact."""
    env = Env(cap)
    ring = env.ring
    advance(env, slots % (cap // 8))
    # records that fit before the dead claim (three large ones can overfill a 1 KiB ring)
    pre = [r for r in (payload(100 + i, n) for i, n in enumerate(before)) if ring.try_push(r, LIVE)]
    tail, head = env.load_counter(TAIL_OFFSET), env.load_counter(HEAD_OFFSET)
    assume(Model(cap, tail, early=False).place(tail, length) - head <= cap)  # (as dead_claim places it)
    wraps = dead_claim(env, length, mode)
    event(f"dead claim {mode}, wraps={wraps}")
    post = [r for r in (payload(200 + i, n) for i, n in enumerate(after)) if ring.try_push(r, LIVE)]

    assert ring.pop_batch() == pre  # everything before the dead claim is delivered
    assert ring.poll(lambda v: None) == 0  # then the consumer is blocked
    assert ring.readable()

    unblocks = 0
    for _ in range(3):
        blocked = ring.blocked_producer()
        if blocked is None:
            break
        if blocked == -1:  # zero header: only when no live producer claims the head
            head = ring.head_position
            assert not ring.unblock(lambda p, t: True)
            assert not ring.unblock(lambda p, t: False)
            assert not ring.unblock(lambda p, t: True, lambda: [head])
            assert ring.poll(lambda v: None) == 0
            assert ring.unblock(lambda p, t: True, lambda: [head + 1 << 20])
        else:  # a named producer: when the caller says it is dead, or no live one writes there
            assert blocked == DEAD
            head = ring.head_position
            assert not ring.unblock(lambda p, t: False)
            assert not ring.unblock(lambda p, t: p != DEAD)
            assert not ring.unblock(lambda p, t: True, lambda: [head])  # a live claim at the head
            assert ring.poll(lambda v: None) == 0
            if unblocks % 2:
                assert ring.unblock(lambda p, t: p == DEAD and t == 0)
            else:
                assert ring.unblock(lambda p, t: False, lambda: [head + 1 << 20])
        unblocks += 1
        got = ring.pop_batch()
        if ring.blocked_producer() is not None:
            assert got == []
    else:
        pytest.fail("still blocked after 3 unblocks")
    assert got == post  # every later record, intact and in order
    assert ring.dropped == unblocks
    expected = {"zero": 2, "hdr": 2, "hdr+pad": 1}[mode] if wraps else 1
    assert unblocks == expected
    assert not ring.readable()
    assert ring.blocked_producer() is None
    exact_roundtrip(env, slots)


def test_unblock_leaves_live_and_committed_records_alone() -> None:
    """unblock() is a no-op on an empty ring, a committed head, and a header of a live producer."""
    env = Env(1024)
    ring = env.ring
    assert not ring.unblock(lambda p, t: True, lambda: ())  # empty
    assert ring.try_push(b"committed", LIVE)
    assert ring.blocked_producer() is None
    assert not ring.unblock(lambda p, t: True, lambda: ())  # committed head
    assert ring.pop() == b"committed"
    dead_claim(env, 40, "hdr")
    assert ring.blocked_producer() == DEAD
    assert not ring.unblock(lambda p, t: p == LIVE)
    assert not ring.unblock(lambda p, t: True, lambda: [ring.head_position])
    assert ring.dropped == 0


# ----------------------------------------------------------------------------- garbage
GARBAGE_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                            suppress_health_check=[HealthCheck.too_slow])


def fill_some(env: Env, model: Model, rng: random.Random, n: int) -> None:
    """Push/pop a few records so the counters and data area hold realistic history."""
    for _ in range(n):
        if rng.random() < 0.6:
            rec = payload(next(model.uid), rng.randrange(0, env.ring.max_payload + 1))
            fits = model.fits(model.tail, len(rec))  # (as the attempt decides: it may look for an early wrap)
            assert env.ring.try_push(rec, rng.randrange(4)) is fits
            if fits:
                model.push(rec)
        else:
            assert env.ring.pop() == model.pop()


def garbage_setup(cap: int, seed: int) -> tuple[Env, Model]:
    env = Env(cap)
    model = Model(cap)
    fill_some(env, model, random.Random(seed), 30)
    return env, model


def recover(env: Env, bound: int) -> bool:
    """Push fresh markers and poll (unblocking a stuck head as a consumer would after a timeout),
    at most ``bound`` rounds, until a marker comes out intact."""
    ring = env.ring
    markers: set[bytes] = set()
    for i in range(bound):
        if not ring.readable():
            m = b"MARKER-%d-" % i + payload(10_000 + i, 40)
            if ring.try_push(m, 1):
                markers.add(m)
        seen: list[bytes] = []
        n = checked_poll(env, seen)
        hits = [j for j, s in enumerate(seen) if s in markers]
        if hits:  # after the first marker only later markers may follow, intact
            assert all(s in markers for s in seen[hits[0]:])
            return True
        if n == 0 and ring.blocked_producer() is not None:
            ring.unblock(lambda p, t: True, lambda: ())
    return False


def exact_roundtrip(env: Env, seed) -> None:
    """Fill until backpressure (at most a ring's worth), drain, compare exactly."""
    ring = env.ring
    assert not ring.readable()
    rng = random.Random(seed)
    recs: list[bytes] = []
    used = 0
    for i in range(4 * env.cap // 8):
        rec = payload(20_000 + i, rng.choice([0, 5, 60, 300]))
        if not ring.try_push(rec, i % 3):
            break
        recs.append(rec)
        used += rec_size(len(rec))
    else:
        pytest.fail("ring never reported backpressure")
    assert used <= env.cap
    assert ring.pop_batch() == recs
    assert env.guards_intact()


@GARBAGE_SETTINGS
@given(
    cap=st.sampled_from([1024, 2048]),
    seed=st.integers(0, 1000),
    garbage=st.data(),
    near_head=st.booleans(),
    head=st.one_of(st.none(), aligned_counter(2048)),
    tail=st.one_of(st.none(), aligned_counter(2048)),
)
def test_garbage_poll_never_raises_or_escapes(cap, seed, garbage, near_head, head, tail) -> None:
    """Garbage data and aligned garbage counters: poll/unblock never raise, views stay in the data area."""
    env, _ = garbage_setup(cap, seed)
    apply_data_garbage(env, garbage.draw(data_garbage(cap)), near_head)
    if head is not None:
        env.store_counter(HEAD_OFFSET, resolve(head, env.load_counter(HEAD_OFFSET)))
    if tail is not None:
        env.store_counter(TAIL_OFFSET, resolve(tail, env.load_counter(TAIL_OFFSET)))
    seen: list[bytes] = []
    for limit in (1, 3, 1 << 30, 1 << 30):
        checked_poll(env, seen, limit)
        if env.ring.blocked_producer() is not None:
            env.ring.unblock(lambda p, t: True, (lambda: ()) if limit > 3 else None)
        env.ring.readable()
        env.ring.free_space()
    assert env.guards_intact()


@GARBAGE_SETTINGS
# a committed DATA header one byte longer than a producer may write, inside the data area
@example(cap=1024, seed=245, near_head=False,
         garbage=(None, [(0, 1 << 48)] * 3 + [(0, 0), (0, 0x40010000000001F9)]))
@given(cap=st.sampled_from([1024, 2048]), seed=st.integers(0, 1000), garbage=data_garbage(2048),
       near_head=st.booleans())
def test_garbage_data_then_recovers(cap, seed, garbage, near_head) -> None:
    """Garbage over the data area: within bounded polls/unblocks a fresh record comes out, then exact behaviour."""
    env, _ = garbage_setup(cap, seed)
    apply_data_garbage(env, garbage, near_head)
    assert recover(env, bound=cap // 4 + 8), "ring never delivered a fresh record after garbage"
    exact_roundtrip(env, seed)


@GARBAGE_SETTINGS
@given(
    seed=st.integers(0, 1000),
    garbage=data_garbage(1024),
    sign=st.sampled_from([-1, 1]),
    k=st.integers(0, 1 << 40),
)
def test_far_garbage_head_resyncs_and_recovers(seed, garbage, sign, k) -> None:
    """A head thrown more than a lap off is resynced: a fresh record comes out, then exact behaviour."""
    cap = 1024
    env, _ = garbage_setup(cap, seed)
    apply_data_garbage(env, garbage)
    env.store_counter(HEAD_OFFSET, far_from(env.load_counter(TAIL_OFFSET), sign, k, cap))
    assert recover(env, bound=cap // 4 + 8), "ring never delivered a fresh record after resync"
    exact_roundtrip(env, seed)


@GARBAGE_SETTINGS
@example(seed=0, garbage=(None, []), head=None, tail=("abs", 13))  # misaligned tail
@given(
    seed=st.integers(0, 1000),
    garbage=data_garbage(1024),
    head=st.one_of(st.none(), st.integers(0, 2**64 - 1).map(lambda v: ("abs", v)), aligned_counter(1024)),
    tail=st.one_of(st.none(), st.integers(0, 2**64 - 1).map(lambda v: ("abs", v)), aligned_counter(1024)),
)
def test_garbage_counters_then_recovers(seed, garbage, head, tail) -> None:
    """After garbage in data and counters, nothing raises, and a fresh record comes out within bounded polls."""
    cap = 1024
    env, _ = garbage_setup(cap, seed)
    apply_data_garbage(env, garbage, near_head=True)
    if head is not None:
        env.store_counter(HEAD_OFFSET, resolve(head, env.load_counter(HEAD_OFFSET)))
    if tail is not None:
        env.store_counter(TAIL_OFFSET, resolve(tail, env.load_counter(TAIL_OFFSET)))
    assert recover(env, bound=cap // 4 + 8), "ring never delivered a fresh record after garbage"
    exact_roundtrip(env, seed)


# ----------------------------------------------------------------------------- garbage counters and headers (regressions)
def test_misaligned_garbage_head_poll_does_not_raise() -> None:
    """A garbage head that is not 8-byte aligned (but within a lap of the tail) does not make poll raise."""
    env = Env(1024)
    assert env.ring.try_push(b"x" * 100)
    env.store_counter(HEAD_OFFSET, 3)
    env.ring.poll(lambda view: None)


def test_misaligned_garbage_tail_producers_keep_working() -> None:
    """A garbage tail that is not 8-byte aligned: after the consumer resyncs, producers can push again."""
    env = Env(1024)
    env.store_counter(TAIL_OFFSET, 13)
    assert recover(env, bound=16)


def test_tail_near_u64_max_producers_keep_working() -> None:
    """A garbage tail just below 2**64: after the consumer resyncs, producers can push again."""
    env = Env(1024)
    env.store_counter(TAIL_OFFSET, 2**64 - 8)
    assert recover(env, bound=16)


def test_backpressure_survives_garbage_head_seen_by_producer() -> None:
    """After a garbage head (seen by a producer) is resynced, a full ring again refuses pushes: no silent loss."""
    env = Env(1024)
    ring = env.ring
    while ring.try_push(b"x" * 100):
        pass
    env.store_counter(HEAD_OFFSET, 1 << 40)
    ring.try_push(b"y" * 100)  # producer sees a full ring, reloads the head: garbage enters its cache
    checked_poll(env, [])  # consumer: tail < head, resync (head := tail)
    assert not ring.readable()
    exact_roundtrip(env, 1)


@pytest.mark.parametrize("head,tail", [(4096 + 3, 4096), (2**64 - 8, 2**64 - 16), (8, 2**64 - 5)])
def test_consumer_made_over_garbage_counters_recovers(head: int, tail: int) -> None:
    """A consumer that attaches while garbage sits in both counters (misaligned, near 2**64)
    never raises or indexes outside the ring; producers keep working after its repair."""
    env = Env(4096)
    env.store_counter(HEAD_OFFSET, head)
    env.store_counter(TAIL_OFFSET, tail)
    ring = MpscRing(env.buf, env.mem, GUARD, 4096)
    ring.attach()
    got, sent = [], []
    for i in range(30):
        rec = payload(i, 50 + 13 * i)
        if ring.try_push_parts((rec,), 1):
            sent.append(rec)
        ring.poll(lambda view: got.append(bytes(view)))
    assert len(sent) >= 25 and got == sent[len(sent) - len(got):] and len(got) >= 25
    assert env.guards_intact()
