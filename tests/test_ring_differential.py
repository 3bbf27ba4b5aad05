"""Differential test: cxlrpc/_ring.c (RingCore.poll/_push_spsc/_push_mpsc) against the Python
reference (_poll_py, SpscRing._try_push_parts_py, MpscRing._try_push_parts_py) on identical
garbage states.

Two rings are laid over two mmaps holding the same bytes (guard bytes on both sides of the
ring), their private state (_head_local, _tail_local, _head_cache, _wrap_from, dropped) is set to the same
drawn values, the native method runs on one and the reference on the other, and everything
observable is compared: return value or exception type, every byte of both mmaps (guards
included), the private state, the delivered payloads, the claim word and the revoked() calls.

  *_sane   counters aligned and below 2**62 (what a correct peer ever produces).
  *_any    counters anywhere in u64, misaligned too (a hostile peer).

The pinned cases below are the ones a review of the native code found (each failed before its
fix). DIFF_EXAMPLES=3000 runs a deeper search than the default.
"""
from __future__ import annotations

import mmap
import os
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cxlrpc.memory import AtomicMemory
from cxlrpc.ring import MpscRing, SpscRing, base, ring_size
from cxlrpc.ring.mpsc import NO_CLAIM
from cxlrpc.ring.record import (COMMITTED, CONTROL_SIZE, HEAD_OFFSET, KIND_DATA,
                                KIND_PADDING, PAD_CLEAN, TAIL_OFFSET)

pytestmark = [pytest.mark.skipif(not base.NATIVE, reason="cxlrpc._ring not built"), pytest.mark.timeout(300)]

GUARD = 256
CAP = 1024
U64 = (1 << 64) - 1
TOTAL = GUARD + ring_size(CAP) + GUARD
DATA = GUARD + CONTROL_SIZE
SETTINGS = settings(max_examples=int(os.environ.get("DIFF_EXAMPLES", "150")),
                    deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)


class Abort(Exception):
    """Raised by a handler after too many calls (the reference never makes more than CAP/8)."""


# ----------------------------------------------------------------------------- strategies
BASES_SANE = [0, 8 * CAP, 5 * CAP + 512, (1 << 62) - 2 * CAP]
BASES_ANY = BASES_SANE + [(1 << 62) - 16, 1 << 62, 1 << 63, (1 << 64) - 2 * CAP, (1 << 64) - 16]


def counter(sane: bool):
    bases = BASES_SANE if sane else BASES_ANY
    near = st.builds(lambda b, k: max(0, min(U64, b + 8 * k)), st.sampled_from(bases),
                     st.integers(-2 * CAP // 8, 2 * CAP // 8))
    if sane:
        return near.filter(lambda v: v < (1 << 62))
    return st.one_of(near, st.builds(lambda v, m: min(U64, v + m), near, st.integers(1, 7)),
                     st.integers(0, U64))


@st.composite
def related(draw, sane: bool):
    """(a, b) where b is usually within a couple of laps of a."""
    a = draw(counter(sane))
    if draw(st.booleans()):
        b = draw(counter(sane))
    else:
        b = a + 8 * draw(st.integers(-CAP // 8 - 4, 2 * CAP // 8 + 4))
        if not sane and draw(st.integers(0, 9)) == 0:
            b += draw(st.integers(1, 7))
        b = max(0, min(U64, b))
        if sane:
            assume(b < (1 << 62))
    return a, b


def header(kind: int, length: int, committed: bool, producer: int = 0, tag: int = 0) -> int:
    return (COMMITTED if committed else 0) | (tag << 56) | (kind << 48) | (producer << 32) | length


@st.composite
def data_area(draw, start: int, multi: bool) -> bytearray:
    """A chain of records from ``start`` (wrapping, with end padding sometimes, clean or not,
    over zero or garbage), then garbage."""
    area = bytearray(CAP) if multi or draw(st.booleans()) else bytearray(draw(st.binary(min_size=CAP, max_size=CAP)))
    idx = start & (CAP - 1) & ~7
    for _ in range(draw(st.integers(0, 12))):
        to_end = CAP - idx
        choice = draw(st.integers(0, 9))
        dirty = not multi
        if choice == 0:  # wrap padding to the end
            w, size = header(KIND_PADDING, to_end - 8, True), to_end
        else:
            length = draw(st.sampled_from([0, 1, 7, 8, 13, 40, 100, 200, 504, to_end - 8, to_end]))
            kind = KIND_DATA if choice < 8 else draw(st.sampled_from([KIND_PADDING, 0, 3, 0xFF]))
            committed = draw(st.integers(0, 9)) > 0
            w = header(kind, length, committed, draw(st.integers(0, 3)), draw(st.integers(0, 3)))
            size = 8 + ((length + 7) & ~7)
        if w >> 48 & 0xFF == KIND_PADDING:
            w |= PAD_CLEAN if draw(st.booleans()) else 0
            dirty = dirty or draw(st.integers(0, 3)) == 0  # garbage in its body
        area[idx:idx + 8] = w.to_bytes(8, "little")
        for j in range(idx + 8, min(CAP, idx + size)):
            area[j] = (j * 37 + 11) & 0xFF if dirty else area[j]
        idx = (idx + size) % CAP
    for _ in range(draw(st.integers(0, 3))):  # stray garbage words
        at = draw(st.integers(0, CAP // 8 - 1)) * 8
        area[at:at + 8] = draw(st.integers(0, U64)).to_bytes(8, "little")
    return area


def wrap_from(tail: int):
    """Where the producer next looks for an early wrap: from the start, at or near ``tail``
    (the hot span is CAP // 4), far ahead, or anywhere."""
    return st.one_of(st.just(0), st.sampled_from([-8, 0, 8, CAP // 4 - 8, CAP // 4, CAP // 4 + 8, 4 * CAP])
                     .map(lambda d: max(0, min(U64, tail + d))), st.integers(0, U64))


# ----------------------------------------------------------------------------- ring pairs
def make_pair(cls, tail_word: int, head_word: int, area: bytes, state: dict):
    rings = []
    for _ in range(2):
        mm = mmap.mmap(-1, TOTAL)
        mm[:] = b"\xa5" * TOTAL
        mem = AtomicMemory(mm)
        ring = cls(memoryview(mm), mem, GUARD, CAP)
        mm[GUARD + TAIL_OFFSET:GUARD + TAIL_OFFSET + 8] = tail_word.to_bytes(8, "little")
        mm[GUARD + HEAD_OFFSET:GUARD + HEAD_OFFSET + 8] = head_word.to_bytes(8, "little")
        mm[DATA:DATA + CAP] = area
        for k, v in state.items():
            setattr(ring, k, v)
        rings.append((ring, mm))
    return rings


def snapshot(ring, mm) -> tuple:
    return (bytes(mm), ring._head_local, ring._tail_local, ring._head_cache, ring._wrap_from, ring.dropped)


def outcome(fn):
    try:
        return ("ok", fn())
    except Abort:
        return ("abort", None)
    except Exception as e:  # noqa: BLE001 - the type is what we compare
        return ("raise", type(e).__name__)


def describe(a: tuple, b: tuple) -> str:
    out = []
    if a[0] != b[0]:
        diff = [i for i in range(TOTAL) if a[0][i] != b[0][i]]
        where = lambda i: ("guard-before" if i < GUARD else "control" if i < DATA else
                           "data" if i < DATA + CAP else "guard-after")
        out.append(f"bytes differ at {len(diff)} offsets, first {diff[:4]} ({where(diff[0])})")
    for name, x, y in zip(("_head_local", "_tail_local", "_head_cache", "_wrap_from", "dropped"), a[1:], b[1:]):
        if x != y:
            out.append(f"{name}: native {x} reference {y}")
    return "; ".join(out)


def check(native, ref, res_n, res_r, extra_n=None, extra_r=None):
    sn, sr = snapshot(*native), snapshot(*ref)
    assert res_n == res_r, f"result: native {res_n} reference {res_r}; {describe(sn, sr)}"
    assert extra_n == extra_r, f"side effects: native {extra_n} reference {extra_r}"
    assert sn == sr, describe(sn, sr)
    # an out-of-bounds write by either side shows in the guards
    for mm in (native[1], ref[1]):
        assert bytes(mm[:GUARD]) == b"\xa5" * GUARD and bytes(mm[-GUARD:]) == b"\xa5" * GUARD, "guard hit"


# ----------------------------------------------------------------------------- poll
def run_poll(cls, sane, data):
    head_local, tail = data.draw(related(sane), "head_local, tail")
    head_word = data.draw(st.sampled_from([head_local, head_local + 8, 0]) if sane else
                          st.one_of(st.just(head_local), st.integers(0, U64)), "head word")
    head_word = min(head_word, U64)
    multi = cls is MpscRing
    area = data.draw(data_area(head_local, multi), "area")
    limit = data.draw(st.sampled_from([1 << 30, 0, 1, 2, 3, -1]), "limit")
    raise_at = data.draw(st.sampled_from([None, 0, 1, 2]), "handler raises at call")
    native, ref = make_pair(cls, tail, head_word, area, {"_head_local": head_local})
    got = ([], [])

    def handler(k):
        def h(view):
            got[k].append(bytes(view))
            if len(got[k]) > 4 * CAP:
                raise Abort
            if raise_at is not None and len(got[k]) == raise_at + 1:
                raise KeyError("handler fails")
        return h

    res_n = outcome(lambda: native[0].poll(handler(0), limit))
    res_r = outcome(lambda: native[0].__class__._poll_py(ref[0], handler(1), limit))
    check(native, ref, res_n, res_r, got[0], got[1])


@pytest.mark.parametrize("cls", [SpscRing, MpscRing])
@SETTINGS
@given(data=st.data())
def test_poll_sane(cls, data):
    run_poll(cls, True, data)


@pytest.mark.parametrize("cls", [SpscRing, MpscRing])
@SETTINGS
@given(data=st.data())
def test_poll_any(cls, data):
    run_poll(cls, False, data)


# ----------------------------------------------------------------------------- SPSC push
def run_spsc_push(sane, data):
    tail_local, head_cache = data.draw(related(sane), "tail_local, head_cache")
    tail_word = data.draw(st.one_of(st.just(tail_local), counter(sane)), "tail word")
    head_word = data.draw(st.one_of(st.just(head_cache), st.just(tail_local), related(sane).map(lambda p: p[1]),
                                    counter(sane)), "head word")
    area = data.draw(data_area(tail_local, False), "area")
    n = data.draw(st.sampled_from([0, 1, 5, 7, 8, 100, 200, 496, 504, 505]), "length")
    nparts = data.draw(st.integers(1, 3), "parts")
    rec = bytes((i * 7 + 3) & 0xFF for i in range(n))
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=nparts - 1, max_size=nparts - 1)))
    parts = tuple(rec[a:b] for a, b in zip([0] + cuts, cuts + [n]))
    state = {"_tail_local": tail_local, "_head_cache": head_cache,
             "_wrap_from": data.draw(wrap_from(tail_local), "wrap_from")}
    native, ref = make_pair(SpscRing, tail_word, head_word, area, state)
    res_n = outcome(lambda: native[0].try_push_parts(parts))
    res_r = outcome(lambda: SpscRing._try_push_parts_py(ref[0], parts))
    check(native, ref, res_n, res_r)


@SETTINGS
@given(data=st.data())
def test_spsc_push_sane(data):
    run_spsc_push(True, data)


@SETTINGS
@given(data=st.data())
def test_spsc_push_any(data):
    run_spsc_push(False, data)


# ----------------------------------------------------------------------------- MPSC push
def run_mpsc_push(sane, data):
    tail_word, head_word = data.draw(related(sane), "tail word, head word")
    if data.draw(st.integers(0, 3)) == 0:
        head_word = tail_word  # empty: the producer may wrap early
    head_cache = data.draw(st.one_of(st.just(head_word), counter(sane)), "head_cache")
    area = data.draw(data_area(tail_word, True), "area")
    # a consumer's padding or garbage where our header goes (tests the _open/_revoke callouts)
    if data.draw(st.integers(0, 3)) == 0:
        at = (tail_word & (CAP - 1)) & ~7
        area[at:at + 8] = data.draw(st.sampled_from(
            [header(KIND_PADDING, 200, True, 3), 0xDEADBEEF, header(KIND_DATA, 8, False, 3)])).to_bytes(8, "little")
    if data.draw(st.integers(0, 3)) == 0:
        area[0:8] = data.draw(st.sampled_from([header(KIND_PADDING, 64, True), 0xBAD])).to_bytes(8, "little")
    n = data.draw(st.sampled_from([0, 1, 7, 8, 100, 200, 496, 504, 505]), "length")
    rec = bytes((i * 5 + 1) & 0xFF for i in range(n))
    parts = (rec[: n // 2], rec[n // 2:])
    producer = data.draw(st.sampled_from([0, 3, 0xFFFF, 0x10000, -1]), "producer")
    tag = data.draw(st.sampled_from([0, 5, 63, 64]), "tag")
    use_claim = data.draw(st.booleans(), "claim")
    answers = data.draw(st.lists(st.booleans(), min_size=6, max_size=6), "revoked() answers")
    use_revoked = data.draw(st.booleans(), "revoked")
    # the "consumer" acts while we push: moves the head past our claim (at claim.store), and
    # pads/garbles our header (at the first revoked() call) -> _revoke / _lost_commit paths
    bump_head = data.draw(st.sampled_from([None, 8, 64, 4096]), "claim.store moves head by")
    garble = data.draw(st.sampled_from([None, header(KIND_PADDING, 100, True), 0x77]), "revoked() garbles header")
    native, ref = make_pair(MpscRing, tail_word, head_word, area,
                            {"_head_cache": head_cache, "_wrap_from": data.draw(wrap_from(tail_word), "wrap_from")})
    results = []
    for k, (ring, mm) in enumerate((native, ref)):
        cmm = mmap.mmap(-1, 4096)
        cmem = AtomicMemory(cmm)
        counter_ = cmem.counter(0)
        counter_.store(12345 * 8, 0)

        class Claim:
            def store(self, v, order, counter_=counter_, ring=ring):
                counter_.store(v, order)
                if bump_head is not None and v != NO_CLAIM:
                    ring.mem.store(GUARD + HEAD_OFFSET, v + bump_head, 0)

            def load(self, order, counter_=counter_):
                return counter_.load(order)

        claim = Claim() if use_claim else None
        calls = []

        def revoked(calls=calls, ring=ring):
            calls.append(True)
            if garble is not None and len(calls) == 1:
                t = tail_word & (CAP - 1)
                for at in {t, 0}:
                    if ring.mem.load(DATA + at, 0) & ~COMMITTED == (tag << 56) | (KIND_DATA << 48) | (producer << 32) | n:
                        ring.mem.store(DATA + at, garble, 0)
            return answers[min(len(calls) - 1, 5)]

        rv = revoked if use_revoked else None
        if k == 0:
            res = outcome(lambda: ring.try_push_parts(parts, producer, tag, claim, rv))
        else:
            res = outcome(lambda: MpscRing._try_push_parts_py(ring, parts, producer, tag, claim, rv))
        results.append((res, (claim.load(0) if claim is not None else None, len(calls))))
    check(native, ref, results[0][0], results[1][0], results[0][1], results[1][1])


@SETTINGS
@given(data=st.data())
def test_mpsc_push_sane(data):
    run_mpsc_push(True, data)


@SETTINGS
@given(data=st.data())
def test_mpsc_push_any(data):
    run_mpsc_push(False, data)


# ----------------------------------------------------------------------------- pinned cases
def test_poll_near_2_64_drops_the_record_as_the_reference():
    """head_local = 2**64-16 (adopted by attach()/__init__ from a garbage head word), tail =
    2**64-8: the reference drops the record (``pos + size`` wrapped in C, and its loop walked
    the ring lap after lap)."""
    area = bytearray(CAP)
    for i in range(0, CAP, 16):
        area[i:i + 8] = header(KIND_DATA, 8, True).to_bytes(8, "little")
    h, t = (1 << 64) - 16, (1 << 64) - 8
    native, ref = make_pair(SpscRing, t, h, area, {"_head_local": h})
    calls = [0, 0]

    def handler(k):
        def f(view):
            calls[k] += 1
            if calls[k] > 1000:
                raise Abort
        return f

    res_n = outcome(lambda: native[0].poll(handler(0)))
    res_r = outcome(lambda: SpscRing._poll_py(ref[0], handler(1)))
    assert (res_n, calls[0]) == (res_r, calls[1])


def test_spsc_push_misaligned_tail_writes_nothing_past_the_ring():
    """_tail_local misaligned (SpscRing.__init__/attach() adopt the tail word unvalidated)
    with idx = CAP-3: the reference's store raises ValueError (misaligned) and writes nothing
    (the C wrote an 8-byte padding header at data+CAP-3, 5 bytes past the ring)."""
    t = 4 * CAP + CAP - 3
    hc = 4 * CAP + CAP - 8
    native, ref = make_pair(SpscRing, t, hc, bytes(CAP), {"_tail_local": t, "_head_cache": hc})
    res_n = outcome(lambda: native[0].try_push_parts((b"abc",)))
    res_r = outcome(lambda: SpscRing._try_push_parts_py(ref[0], (b"abc",)))
    check(native, ref, res_n, res_r)


def test_poll_misaligned_head_reads_nothing_past_the_ring():
    """_head_local misaligned with idx = CAP-3 (adopted unvalidated from the head word): the C
    loaded 8 bytes at data+CAP-3; the reference raises ValueError."""
    h = 4 * CAP + CAP - 3
    native, ref = make_pair(SpscRing, h + 11, h, bytes(CAP), {"_head_local": h})
    res_n = outcome(lambda: native[0].poll(lambda v: None))
    res_r = outcome(lambda: SpscRing._poll_py(ref[0], lambda v: None))
    check(native, ref, res_n, res_r)


def test_nine_parts():
    """Any number of parts (the C takes up to MAX_PARTS=8 and hands more to the reference)."""
    parts = (b"ab",) * 9
    for cls in (SpscRing, MpscRing):
        native, ref = make_pair(cls, 0, 0, bytes(CAP), {"_head_local": 0, "_head_cache": 0, "_tail_local": 0})
        res_n = outcome(lambda: native[0].try_push_parts(parts))
        res_r = outcome(lambda: cls._try_push_parts_py(ref[0], parts))
        check(native, ref, res_n, res_r)


def test_keyword_arguments():
    """Keywords (producer=..., limit=...) as the reference takes them."""
    native, ref = make_pair(MpscRing, 0, 0, bytes(CAP), {"_head_local": 0, "_head_cache": 0})
    res_n = outcome(lambda: native[0].try_push_parts((b"x",), producer=2))
    res_r = outcome(lambda: MpscRing._try_push_parts_py(ref[0], (b"x",), producer=2))
    assert res_n == res_r


def test_spsc_push_tail_near_2_64_wraps():
    """_tail_local = 2**64-8, _head_cache = 0: the reference sees 2**64 > cap, finds the head
    invalid and returns False (in C ``tail + need - head_cache`` wrapped to 0, and the record
    went over unread space)."""
    t = (1 << 64) - 8
    native, ref = make_pair(SpscRing, t, 0, bytes(CAP), {"_tail_local": t, "_head_cache": 0})
    res_n = outcome(lambda: native[0].try_push_parts((b"",)))
    res_r = outcome(lambda: SpscRing._try_push_parts_py(ref[0], (b"",)))
    check(native, ref, res_n, res_r)


@pytest.mark.parametrize("start", [0, 8 * CAP + CAP - 16])
@pytest.mark.parametrize("second", [False, True])
def test_mpsc_lost_commit_and_revoke_paths(start, second):
    """The consumer moves the head past our claim (at claim.store) and pads our header (at the
    first revoked() call): _revoke or (after the copy) _lost_commit, with the same arguments."""
    native, ref = make_pair(MpscRing, start, start, bytes(CAP), {"_head_cache": start})
    seen = []
    for k, (ring, mm) in enumerate((native, ref)):
        c = AtomicMemory(mmap.mmap(-1, 4096)).counter(0)
        log = []
        for name in ("_revoke", "_lost_commit", "_open"):
            orig = getattr(MpscRing, name)
            setattr(ring, name, (lambda orig, name: lambda *a: (log.append((name, a[:-1] if name == "_open" else a)), orig(ring, *a))[1])(orig, name))

        class Claim:
            def store(self, v, o):
                c.store(v, o)
                if v != NO_CLAIM:
                    ring.mem.store(GUARD + HEAD_OFFSET, v + 64, 0)
        calls = []

        def revoked():
            calls.append(1)
            if len(calls) == 1:
                for at in (start & (CAP - 1), 0):
                    if ring.mem.load(DATA + at, 0) & 0xFFFF_FFFF == 200:
                        ring.mem.store(DATA + at, header(KIND_PADDING, 100, True), 0)
            return second and len(calls) > 1
        push = ring.try_push_parts if k == 0 else ring._try_push_parts_py
        res = outcome(lambda: push((b"a" * 120, b"b" * 80), 3, 1, Claim(), revoked))
        seen.append((res, len(calls), c.load(0), log))
    check(native, ref, seen[0][0], seen[1][0], seen[0][1:], seen[1][1:])


CLOSE_SCRIPT = r"""
import mmap, sys
from cxlrpc.memory import AtomicMemory
from cxlrpc.ring import MpscRing, ring_size
impl = sys.argv[1]
mm = mmap.mmap(-1, ring_size(4096))
mem = AtomicMemory(mm); buf = memoryview(mm)
ring = MpscRing(buf, mem, 0, 4096); ring.reset()
class Claim:  # stands in for the consumer moving the head while we claim
    def store(self, v, order):
        if v != 1 << 63:
            mem.store(128, v + 64, 0)
def revoked():  # e.g. holds_slot() while another thread shuts the client down
    mem.close(); buf.release(); mm.close()
    return False
push = ring.try_push_parts if impl == "native" else ring._try_push_parts_py
try:
    push((b"x" * 100,), 1, 0, Claim(), revoked)
    print("returned")
except Exception as e:
    print("raised", type(e).__name__, e)
"""


def test_mpsc_push_never_touches_the_mapping_after_a_callout_closed_it():
    """The MPSC push checks the region again after each Python callout (claim.store, _open,
    revoked()): a region closed meanwhile raises instead of being written after munmap."""
    import subprocess
    out = {}
    for impl in ("native", "reference"):
        p = subprocess.run([sys.executable, "-c", CLOSE_SCRIPT, impl], capture_output=True, text=True, timeout=60)
        out[impl] = (p.returncode, p.stdout.strip())
    assert out["native"][0] == 0 and out["native"][1].startswith("raised"), out

