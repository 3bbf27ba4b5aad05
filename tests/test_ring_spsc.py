"""SpscRing: model-checked push/pop sequences, cross-process delivery over POSIX shm, garbage.

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
from hypothesis import HealthCheck, example, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cxlrpc.memory import RELEASE, AtomicMemory
from cxlrpc.ring import SpscRing, max_payload, ring_size
from cxlrpc.ring.record import HEAD_OFFSET, TAIL_OFFSET, hot_span

from ring_env import (CAPACITIES, aligned_counter, apply_data_garbage, checked_poll, data_garbage, far_from,
                      make_record, resolve, TAG, GUARD, Env as _Env, Model, payload, rec_size, sizes)


def Env(cap: int, start: int = 0) -> _Env:
    return _Env(SpscRing, cap, start)

# ----------------------------------------------------------------------------- model test
class SpscMachine(RuleBasedStateMachine):
    """Random push/push_parts/push_batch/pop/pop_batch/poll against a deque model."""

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

    @rule(data=st.data())
    def push(self, data) -> None:
        rec = self._new(data.draw(sizes(self.maxp)))
        expect = self.model.fits(self.model.tail, len(rec))
        assert self.ring.try_push(rec) is expect
        if expect:
            self.model.push(rec)

    @rule(data=st.data())
    def push_parts(self, data) -> None:
        total = data.draw(sizes(self.maxp))
        cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=4)))
        rec = self._new(total)
        parts = [rec[a:b] for a, b in zip([0] + cuts, cuts + [total])]
        if data.draw(st.booleans()):
            parts = [memoryview(p) for p in parts]
        expect = self.model.fits(self.model.tail, total)
        assert self.ring.try_push_parts(parts) is expect
        if expect:
            self.model.push(rec)

    @rule(data=st.data())
    def push_batch(self, data) -> None:
        recs = [self._new(n) for n in data.draw(st.lists(sizes(self.maxp), max_size=8))]
        expect, tail = 0, self.model.tail
        for r in recs:
            if not self.model.fits(tail, len(r)):
                break
            tail = self.model.place(tail, len(r))
            expect += 1
        assert self.ring.try_push_batch(iter(recs)) == expect
        for r in recs[:expect]:
            self.model.push(r)

    @rule(data=st.data(), how=st.sampled_from(["push", "parts", "batch"]))
    def push_oversize(self, data, how: str) -> None:
        n = data.draw(st.one_of(st.integers(self.maxp + 1, self.maxp + 16),
                                st.integers(self.maxp + 1, 4 * self.env.cap)))
        rec = self._new(n)
        free = self.ring.free_space()
        with pytest.raises(ValueError):
            if how == "push":
                self.ring.try_push(rec)
            elif how == "parts":
                self.ring.try_push_parts([rec[:3], rec[3:]])
            else:
                self.ring.try_push_batch([rec])
        assert self.ring.free_space() == free  # nothing published

    @rule(data=st.data())
    def push_batch_with_oversize(self, data) -> None:
        """A batch reaching an oversize record raises and publishes nothing of the batch."""
        ok = [self._new(n) for n in data.draw(st.lists(st.integers(0, 64), max_size=3))]
        free = self.ring.free_space()
        fit, tail = 0, self.model.tail
        for r in ok:
            if not self.model.fits(tail, len(r)):
                break
            tail = self.model.place(tail, len(r))
            fit += 1
        batch = ok + [self._new(self.maxp + 1)]
        if fit == len(ok):
            with pytest.raises(ValueError):
                self.ring.try_push_batch(batch)
            assert self.ring.free_space() == free
        else:  # stops at the first record that does not fit, before reaching the oversize one
            assert self.ring.try_push_batch(batch) == fit
            for r in ok[:fit]:
                self.model.push(r)

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
        assert self.ring.dropped == 0
        assert self.env.guards_intact()


SpscMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestSpscModel = SpscMachine.TestCase
TestSpscModel.__doc__ = "Random operation sequences: no record lost, duplicated, reordered or corrupted; exact backpressure."


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
        assert ring.try_push(big)
        assert ring.pop() == big
    assert env.guards_intact()


@pytest.mark.parametrize("batch", [False, True])
def test_request_response_traffic_keeps_to_the_hot_span(batch: bool) -> None:
    """Records pushed one at a time into an empty ring stay within its first hot_span bytes
    (plus one record): once the tail is that far in, the next record goes to the start."""
    cap = 1 << 16
    env = Env(cap)
    ring = env.ring
    span = hot_span(cap)
    recs = [payload(i, n) for i, n in enumerate([4000, 100, 0, 9000, 4000, 16000, 50] * 20)]
    for rec in recs:
        assert (ring.try_push_batch([rec]) == 1) if batch else ring.try_push(rec)
        end = env.load_counter(TAIL_OFFSET) % cap
        assert 0 < end <= span + rec_size(len(rec)) + rec_size(16000)
        assert ring.pop() == rec
    assert env.load_counter(TAIL_OFFSET) > cap  # it wrapped, early, over and over
    assert env.guards_intact()


def test_no_early_wrap_while_the_consumer_is_behind() -> None:
    """A producer past the hot span goes on in place while records wait: the start of the
    ring may still hold them, and a batch keeps to one run of bytes."""
    cap = 1 << 16
    env = Env(cap)
    ring = env.ring
    span = hot_span(cap)
    first, second = payload(1, span), payload(2, 500)
    assert ring.try_push(first) and ring.try_push(second)
    assert env.load_counter(TAIL_OFFSET) == rec_size(span) + rec_size(500)
    assert ring.pop() == first  # one still waits: no early wrap
    third = payload(3, 700)
    assert ring.try_push(third)
    assert env.load_counter(TAIL_OFFSET) == rec_size(span) + rec_size(500) + rec_size(700)
    assert ring.pop_batch() == [second, third]
    # empty now: the start again at the producer's next look, a hot_span after its last one
    looked = rec_size(span)  # (where the second record found the first waiting)
    while env.load_counter(TAIL_OFFSET) < cap:
        before = env.load_counter(TAIL_OFFSET)
        assert before < looked + span + rec_size(1)
        assert ring.try_push(b"x")
        assert ring.pop() == b"x"
    assert before >= looked + span and env.load_counter(TAIL_OFFSET) == cap + rec_size(1)


def test_full_ring_rejects_and_stays_intact() -> None:
    """try_push on a full ring returns False and writes nothing: later pops are unaffected."""
    env = Env(1024)
    ring = env.ring
    recs = [payload(i, 100) for i in range(100)]
    pushed = list(itertools.takewhile(ring.try_push, recs))
    assert 0 < len(pushed) < len(recs)
    before = bytes(env.buf)
    assert not ring.try_push(payload(555, ring.max_payload))
    assert not ring.try_push_parts([b"x" * 250, b"y" * 250])
    assert ring.try_push_batch([payload(556, 400)] * 3) == 0
    assert bytes(env.buf) == before  # not a byte changed
    assert ring.pop_batch() == pushed


def test_oversize_raises_value_error() -> None:
    """Payloads above max_payload raise ValueError from every push method, and change nothing."""
    env = Env(2048)
    ring = env.ring
    assert ring.try_push(b"first")
    free = ring.free_space()
    for n in (ring.max_payload + 1, ring.max_payload + 8, 2048, 1 << 20):
        with pytest.raises(ValueError):
            ring.try_push(bytes(n))
        with pytest.raises(ValueError):
            ring.try_push_parts([bytes(n - 1), b"z"])
        with pytest.raises(ValueError):
            ring.try_push_batch([b"ok", bytes(n)])  # the batch's "ok" is not published either
    assert ring.free_space() == free
    assert ring.try_push(bytes(ring.max_payload))
    assert ring.pop_batch() == [b"first", bytes(ring.max_payload)]
    assert env.guards_intact()


# ----------------------------------------------------------------------------- cross-process
SHM_COUNTER = itertools.count()
N_RECORDS = 4000
XP_CAP = 4096


def spsc_producer(shm_name: str, pid: int, count: int, seed: int, timeout: float) -> None:
    """Child process: push ``count`` tagged records, spinning (with a deadline) on backpressure."""
    shm = posix_ipc.SharedMemory(shm_name)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    ring = SpscRing(memoryview(mm), AtomicMemory(mm), 0, XP_CAP)
    ring.attach()
    rng = random.Random(seed)
    deadline = time.monotonic() + timeout
    for seq in range(count):
        rec = make_record(rng, pid, seq, ring.max_payload)
        spins = 0
        while not ring.try_push(rec):
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
        name = f"/cxlrpc-test-{os.getpid()}-{next(SHM_COUNTER)}"
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


def consume_tagged(ring, procs, n_producers: int, count: int, timeout: float) -> dict[int, int]:
    """Poll until every producer's ``count`` records arrived; check order, uniqueness, checksums."""
    next_seq = {p: 0 for p in range(n_producers)}
    errors: list[str] = []

    def handler(view: memoryview) -> None:
        assert len(view) >= TAG.size and len(view) <= ring.max_payload
        pid, seq, crc = TAG.unpack_from(view)
        if pid not in next_seq:
            errors.append(f"unknown producer {pid}")
            return
        if seq != next_seq[pid]:
            errors.append(f"producer {pid}: got seq {seq}, expected {next_seq[pid]}")
        if zlib.crc32(view[TAG.size:]) != crc:
            errors.append(f"producer {pid} seq {seq}: checksum mismatch")
        next_seq[pid] = seq + 1

    deadline = time.monotonic() + timeout
    total = n_producers * count
    got = 0
    idle = 0
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
    assert ring.dropped == 0
    return next_seq


def test_cross_process_spsc_delivery(shm_segment) -> None:
    """A producer process's records arrive in order, exactly once, with matching checksums."""
    name, mm = shm_segment(ring_size(XP_CAP))
    buf, mem = memoryview(mm), AtomicMemory(mm)
    ring = SpscRing(buf, mem, 0, XP_CAP)
    ring.reset()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=spsc_producer, args=(name, 0, N_RECORDS, 1234, 40.0), daemon=True)
    try:
        proc.start()
        seqs = consume_tagged(ring, [proc], 1, N_RECORDS, timeout=40.0)
        assert seqs == {0: N_RECORDS}
        proc.join(10)
        assert proc.exitcode == 0
        assert not ring.readable()
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        del ring
        mem.close()
        buf.release()
        mm.close()


# ----------------------------------------------------------------------------- garbage
GARBAGE_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                            suppress_health_check=[HealthCheck.too_slow])


def fill_some(env: Env, model: Model, rng: random.Random, n: int) -> None:
    """Push/pop a few records so the counters and data area hold realistic history."""
    for _ in range(n):
        if rng.random() < 0.6:
            rec = payload(next(model.uid), rng.randrange(0, env.ring.max_payload + 1))
            fits = model.fits(model.tail, len(rec))  # (as the attempt decides: it may look for an early wrap)
            assert env.ring.try_push(rec) is fits
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
    """Push fresh markers and poll, at most ``bound`` rounds, until a marker comes out intact."""
    ring = env.ring
    markers: set[bytes] = set()
    for i in range(bound):
        if not ring.readable():
            m = b"MARKER-%d-" % i + payload(10_000 + i, 40)
            if ring.try_push(m):
                markers.add(m)
        seen: list[bytes] = []
        checked_poll(env, seen)
        hits = [j for j, s in enumerate(seen) if s in markers]
        if hits:  # after the first marker only later markers may follow, intact
            assert all(s in markers for s in seen[hits[0]:])
            return True
    return False


def exact_roundtrip(env: Env, seed) -> None:
    """After recovery: fill until backpressure (at most a ring's worth), drain, compare exactly."""
    ring = env.ring
    assert not ring.readable()
    rng = random.Random(seed)
    recs: list[bytes] = []
    used = 0
    for i in range(4 * env.cap // 8):
        rec = payload(20_000 + i, rng.choice([0, 5, 60, 300]))
        if not ring.try_push(rec):
            break
        recs.append(rec)
        used += rec_size(len(rec))
    else:
        pytest.fail("ring never reported backpressure after recovery")
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
    """Garbage data and aligned garbage counters: poll never raises, views stay in the data area."""
    env, _ = garbage_setup(cap, seed)
    apply_data_garbage(env, garbage.draw(data_garbage(cap)), near_head)
    if head is not None:
        env.store_counter(HEAD_OFFSET, resolve(head, env.load_counter(HEAD_OFFSET)))
    if tail is not None:
        env.store_counter(TAIL_OFFSET, resolve(tail, env.load_counter(TAIL_OFFSET)))
    seen: list[bytes] = []
    for limit in (1, 3, 1 << 30, 1 << 30):
        checked_poll(env, seen, limit)
        env.ring.readable()
        env.ring.free_space()
    assert env.guards_intact()


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
    assert recover(env, bound=8), "ring never delivered a fresh record after resync"
    exact_roundtrip(env, seed)


@GARBAGE_SETTINGS
@example(seed=0, garbage=(None, [(0, 0x1234)]), head=None, tail=None)  # stall on an uncommitted header
@example(seed=88, garbage=(None, []), head=None, tail=("abs", 8))  # tail thrown back: deadlock
@example(seed=345, garbage=(None, []), head=None, tail=("rel", 2056))  # tail thrown ahead: head cache
@example(seed=0, garbage=(None, []), head=("rel", 40), tail=("rel", 32))  # consumer runs past the real tail
@given(
    seed=st.integers(0, 1000),
    garbage=data_garbage(1024),
    head=st.one_of(st.none(), aligned_counter(1024)),
    tail=st.one_of(st.none(), aligned_counter(1024)),
)
def test_garbage_then_recovers(seed, garbage, head, tail) -> None:
    """After any garbage (data near the head, aligned counters), a fresh record comes out within bounded polls, then exact behaviour."""
    cap = 1024
    env, _ = garbage_setup(cap, seed)
    apply_data_garbage(env, garbage, near_head=True)
    if head is not None:
        env.store_counter(HEAD_OFFSET, resolve(head, env.load_counter(HEAD_OFFSET)))
    if tail is not None:
        env.store_counter(TAIL_OFFSET, resolve(tail, env.load_counter(TAIL_OFFSET)))
    assert recover(env, bound=cap // 8 + 8), "ring never delivered a fresh record after garbage"
    exact_roundtrip(env, seed)


@GARBAGE_SETTINGS
@given(seed=st.integers(0, 1000), garbage=data_garbage(1024))
def test_garbage_in_free_space_is_harmless(seed, garbage) -> None:
    """Garbage written only where no record lives (between tail and head+capacity) never shows."""
    cap = 1024
    env, model = garbage_setup(cap, seed)
    fill, words = garbage
    head, tail = model.head, model.tail
    free = [(head + cap - tail)]  # free bytes start at tail's slot
    rnd = random.Random(fill).randbytes(cap) if fill is not None else None
    for k in range(free[0]):
        i = (tail + k) % cap
        if rnd is not None:
            env.buf[env.data + i] = rnd[i]
    for off, word in words:
        if off < free[0] - 7 and (tail + off) % 8 == 0:
            env.mem.store(env.data + (tail + off) % cap, word, RELEASE)
    assert env.ring.pop_batch() == [model.pop() for _ in range(len(model.q))]
    exact_roundtrip(env, seed)


# ----------------------------------------------------------------------------- garbage counters and headers (regressions)
def test_misaligned_garbage_head_poll_does_not_raise() -> None:
    """A garbage head that is not 8-byte aligned (but within a lap of the tail) does not make poll raise."""
    env = Env(1024)
    assert env.ring.try_push(b"x" * 100)
    env.store_counter(HEAD_OFFSET, 3)
    env.ring.poll(lambda view: None)


def test_uncommitted_garbage_header_does_not_stall_consumer() -> None:
    """A header word without COMMITTED below the tail (no SPSC producer writes one) is dropped, not waited on."""
    env = Env(1024)
    ring = env.ring
    assert ring.try_push(b"a" * 16)
    env.mem.store(env.data, 0x1234, RELEASE)  # garbage header: length 0x1234, no COMMITTED bit
    assert ring.try_push_batch([payload(i, 8) for i in range(5)]) == 5
    checked_poll(env, [])  # the corrupt record and everything up to the tail are dropped
    assert ring.dropped == 1 and not ring.readable()
    fresh = [payload(i, 8) for i in range(5, 10)]
    assert ring.try_push_batch(fresh) == 5
    seen: list[bytes] = []
    checked_poll(env, seen)
    assert seen == fresh


def test_backpressure_survives_garbage_head_seen_by_producer() -> None:
    """After a garbage head (seen by the producer) is resynced, a full ring again refuses pushes: no silent loss."""
    env = Env(1024)
    ring = env.ring
    while ring.try_push(b"x" * 100):
        pass
    env.store_counter(HEAD_OFFSET, 1 << 40)
    ring.try_push(b"y" * 100)  # producer sees a full ring, reloads the head: garbage enters its cache
    checked_poll(env, [])  # consumer: tail < head, resync (head := tail)
    assert not ring.readable()
    exact_roundtrip(env, 1)


def test_garbage_tail_thrown_back_does_not_deadlock() -> None:
    """A tail counter overwritten with a value below the head: the producer can push again after resync."""
    env = Env(1024)
    ring = env.ring
    for i in range(30):  # move the counters a few laps on
        assert ring.try_push(payload(i, 100)) and ring.pop() == payload(i, 100)
    while ring.try_push(payload(99, 100)):  # a full ring: the producer's head cache is fresh
        pass
    env.store_counter(TAIL_OFFSET, 8)  # garbage: far behind the head
    checked_poll(env, [])  # consumer resyncs: head := 8, while the producer's tail is ~3000
    assert recover(env, bound=8), "producer sees a full ring, consumer an empty one: deadlock"


def test_garbage_tail_thrown_ahead_keeps_backpressure() -> None:
    """A tail counter thrown over a lap ahead: after recovery the ring again holds at most a ring's worth."""
    env = Env(1024)
    ring = env.ring
    for i in range(30):
        assert ring.try_push(payload(i, 100)) and ring.pop() == payload(i, 100)
    while ring.try_push(payload(99, 100)):  # a full ring: the producer's head cache is fresh
        pass
    env.store_counter(TAIL_OFFSET, env.load_counter(TAIL_OFFSET) + 2 * 1024 + 8)
    assert recover(env, bound=8)
    exact_roundtrip(env, 2)


@pytest.mark.parametrize("head,tail", [(4096 + 3, 4096), (2**64 - 8, 2**64 - 16), (8, 2**64 - 5),
                                       (2**63, 2**63)])
def test_rings_made_over_garbage_counters_recover(head: int, tail: int) -> None:
    """A consumer and a producer that attach while garbage sits in both counters (misaligned,
    near 2**64) never raise or index outside the ring; their repairs converge and records flow."""
    env = Env(4096)
    env.store_counter(HEAD_OFFSET, head)
    env.store_counter(TAIL_OFFSET, tail)
    consumer = SpscRing(env.buf, env.mem, GUARD, 4096)
    producer = SpscRing(env.buf, env.mem, GUARD, 4096)
    producer.attach()
    consumer.skip_to_tail()
    got, sent = [], []
    for i in range(30):
        rec = payload(i, 50 + 13 * i)
        if producer.try_push_parts((rec,)):
            sent.append(rec)
        consumer.poll(lambda view: got.append(bytes(view)))
    consumer.poll(lambda view: got.append(bytes(view)))
    assert len(sent) >= 25 and got == sent[len(sent) - len(got):] and len(got) >= 25
    assert env.guards_intact()
