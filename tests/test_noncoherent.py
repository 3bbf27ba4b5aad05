"""Memory without cache coherence: the simulator's semantics, the SPSC ring's write-back and
invalidate discipline across processes under it, a mutation test showing that removing any
one guarded flush or invalidate call from the ring makes the transfer fail, and flush mode on
real memory with the CPU's instructions."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cxlrpc.memory import ACQUIRE, RELEASE, _native
from cxlrpc.region import Region
from cxlrpc.ring import SpscRing, ring_size

from nc_ring_peer import guarded_sites, ring_offsets

pytestmark = pytest.mark.timeout(120)
PEER = str(Path(__file__).with_name("nc_ring_peer.py"))
CAPACITY = 4096
COUNT = 2000


def test_simulator_shows_only_written_back_lines_and_only_after_invalidate(name):
    url = f"sim://{name}"
    a = Region.create(url, 1 << 16, kind=9)
    try:
        a.publish()
        b = Region.open(url)
        try:
            assert a.coherence == b.coherence == "flush"
            a.mem.store(8192, 7, RELEASE)
            b.mem.invalidate(8192, 8)
            assert b.mem.load(8192, ACQUIRE) == 0  # not written back: still in a's cache
            a.mem.writeback(8192, 8)
            assert b.mem.load(8192, ACQUIRE) == 0  # written back, but b reads its stale line
            b.mem.invalidate(8192, 8)
            assert b.mem.load(8192, ACQUIRE) == 7
            # lines move whole: b writes another word of the same line and writes it back,
            # clobbering a's newer value there (one writer per line, or updates are lost)
            a.mem.store(8192, 8, RELEASE)
            a.mem.writeback(8192, 8)
            b.mem.store(8200, 1, RELEASE)
            b.mem.writeback(8200, 8)
            a.mem.invalidate(8192, 64)
            assert a.mem.load(8192, ACQUIRE) == 7 and a.mem.load(8200, ACQUIRE) == 1
        finally:
            b.close()
    finally:
        a.unlink()
        a.close()


def _transfer(url: str, mutation: str | None = None, eviction: float = 0.05,
              gate: bool = True) -> tuple[str, str]:
    """Run the two peers over the region's rings; what each printed."""
    args = [url, str(CAPACITY), str(COUNT), str(eviction), str(int(gate)),
            *([mutation] if mutation else [])]
    # a mutation of the Python reference's sites: the peers run the reference (the native rings
    # have their own sites, tests/test_flush_native_ring.py removes those)
    env = {**os.environ, "CXLRPC_NO_NATIVE": "1"} if mutation else None
    peers = [subprocess.Popen([sys.executable, PEER, role, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for role in ("send", "echo")]
    try:
        outs = [p.communicate(timeout=60) for p in peers]
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = "".join(err for _, err in outs)
    assert not errors, f"a peer crashed (not a transfer failure): {errors}"
    return outs[0][0].strip(), outs[1][0].strip()


def _ring_region(url: str, **kw) -> Region:
    off_a, off_b = ring_offsets(CAPACITY)
    region = Region.create(url, off_b + ring_size(CAPACITY), kind=9, **kw)
    for off in (off_a, off_b):
        SpscRing(region.buf, region.mem, off, CAPACITY).reset()
    region.publish()
    return region


@pytest.mark.parametrize("gate", [True, False], ids=["readable-then-poll", "poll"])
@pytest.mark.parametrize("eviction", [0.05, 0.0])
def test_spsc_transfer_is_exact_under_the_simulator(name, gate, eviction):
    """Lock-step transfer both ways, with (or without) random evictions making partial writes
    visible in any order."""
    region = _ring_region(f"sim://{name}")
    try:
        assert _transfer(region.url, eviction=eviction, gate=gate) == (f"ok {COUNT}", f"ok {COUNT}")
    finally:
        region.unlink()
        region.close()


def test_a_consumer_leaves_a_garbage_tail_it_cannot_adopt_to_its_producer(name, monkeypatch):
    """Flush mode: a misaligned tail (garbage) is dropped, never written by the consumer. Its
    store there (a CAS back to its head) would stay dirty in its cache and be written back
    by its next invalidate of the tail, over the tail the producer published meanwhile: the
    record that tail published would be hidden until another push (a caller waiting for its
    reply would wait for ever). Three mappings, three caches: producer, consumer, a stray
    writer."""
    import cxlrpc.simulator
    from cxlrpc.ring.record import TAIL_OFFSET

    monkeypatch.setattr(cxlrpc.simulator, "EVICTION_RATE", 0.0)  # a forgotten line stays so
    region = _ring_region(f"sim://{name}")
    off = ring_offsets(CAPACITY)[0]
    views = [Region.open(region.url) for _ in range(3)]
    try:
        producer, consumer = (SpscRing(v.buf, v.mem, off, CAPACITY) for v in views[:2])
        assert producer.try_push(b"first") and consumer.pop() == b"first"
        stray = views[2].mem
        stray.store(off + TAIL_OFFSET, producer._tail_local + 3, RELEASE)
        stray.writeback(off + TAIL_OFFSET, 8)
        assert consumer.pop() is None and consumer.dropped == 1
        assert producer.try_push(b"second")  # republishes the producer's tail
        got = [consumer.pop() for _ in range(3)]
        assert got[0] == b"second", got
        assert consumer.dropped == 1
        # a garbage tail dropped is not readable: a reader woken by it would spin (the
        # reader task, livelocked, starved its event loop) until the producer's next push
        stray.store(off + TAIL_OFFSET, producer._tail_local + 5, RELEASE)
        stray.writeback(off + TAIL_OFFSET, 8)
        assert consumer.pop() is None and consumer.dropped == 2
        assert not consumer.readable()
        assert producer.try_push(b"third") and consumer.readable() and consumer.pop() == b"third"
    finally:
        for v in views:
            v.close()
        region.unlink()
        region.close()


def test_an_mpsc_consumer_never_writes_the_tail_over_memory_without_coherence(name, monkeypatch):
    """The MPSC consumer's repair of a garbage tail (a CAS back to its head) is for coherent
    memory: over memory without coherence the CAS would land in its cache and be written back
    whole by its next invalidate, a second writer of the producers' line. Memory keeps the
    garbage tail the consumer saw (the ring's producers, not it, own that line)."""
    import cxlrpc.simulator
    from cxlrpc.ring import MpscRing
    from cxlrpc.ring.record import TAIL_OFFSET

    monkeypatch.setattr(cxlrpc.simulator, "EVICTION_RATE", 0.0)
    region = _ring_region(f"sim://{name}")
    off = ring_offsets(CAPACITY)[0]
    views = [Region.open(region.url) for _ in range(2)]
    try:
        consumer = MpscRing(views[0].buf, views[0].mem, off, CAPACITY)
        stray = views[1].mem
        stray.store(off + TAIL_OFFSET, 12345, RELEASE)  # misaligned: garbage
        stray.writeback(off + TAIL_OFFSET, 8)
        for _ in range(2):  # (the second poll's invalidate writes back what the first stored)
            assert consumer.poll(lambda view: None) == 0
        stray.invalidate(off + TAIL_OFFSET, 8)
        assert stray.load(off + TAIL_OFFSET, ACQUIRE) == 12345
        assert consumer.dropped == 1
    finally:
        for v in views:
            v.close()
        region.unlink()
        region.close()


def test_rings_over_memory_without_coherence_never_wrap_early(name):
    """A producer over flushed memory keeps to the plain wrap: an early wrap's padding spans
    most of the ring, and its span would be written back (and invalidated) whole."""
    region = _ring_region(f"sim://{name}")
    try:
        ring = SpscRing(region.buf, region.mem, ring_offsets(CAPACITY)[0], CAPACITY)
        ring.attach()
        tails, rec = [], b"r" * 100  # 112 bytes a record: past the hot span (1 KiB) by the 10th
        for _ in range(60):
            assert ring.try_push(rec) and ring.pop() == rec
            tails.append(ring._tail_local)
        steps = {b - a for a, b in zip(tails, tails[1:])}
        assert steps == {112, 112 + CAPACITY - 36 * 112}  # one wrap, at the end of the buffer
    finally:
        region.unlink()
        region.close()


SITES = guarded_sites()


def test_the_mutation_test_sees_every_guarded_site():
    assert len(SITES) == 9, SITES  # poll x2, readable, release, reserve, push x2, batch x2


def test_every_other_ring_flush_is_off_the_transfer_path():
    """The ring's unguarded write-back/invalidate calls sit in reset, attach, skip_to_tail and
    the counter repairs: no transfer reaches them (a region is published whole after reset, a
    new holder's cold cache is a fresh copy, repairs follow garbage), so the mutation test does
    not remove them; a new call outside these must be guarded or added here."""
    import ast

    from nc_ring_peer import RING
    found = []
    for name in ("base.py", "spsc.py"):
        for node in ast.walk(ast.parse((RING / name).read_text())):
            if isinstance(node, ast.FunctionDef):
                calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)
                         and isinstance(c.func, ast.Attribute) and c.func.attr in ("writeback", "invalidate")]
                if calls and node.name not in ("_poll_py", "_readable_py", "_release", "_reserve",
                                               "_try_push_parts_py", "try_push_batch"):
                    found.append(node.name)
    assert sorted(found) == ["_store_head", "_store_tail", "attach", "attach", "reset",
                             "skip_to_tail"], found


@pytest.mark.parametrize("site", [f"{f}:{n}" for f, n in SITES])
def test_removing_any_flush_or_invalidate_breaks_the_transfer(name, site):
    """The simulator has teeth: without that one call, records arrive corrupt or not at all in
    at least one of the two read paths (no random evictions here: they would eventually
    publish a forgotten line)."""
    region = _ring_region(f"sim://{name}")
    try:
        outcomes = [_transfer(region.url, site, eviction=0.0, gate=gate) for gate in (True, False)]
        failed = [sent for sent, _ in outcomes if not sent.startswith("ok")]
        assert failed, f"removing {site} went unnoticed: {outcomes}"
        assert all(f.startswith(("bad", "timeout")) for f in failed), outcomes
    finally:
        region.unlink()
        region.close()


@pytest.mark.skipif(_native is None, reason="cxlrpc._flush was not built (no C compiler)")
def test_flush_mode_on_shared_memory_uses_the_cpu_instructions(name):
    """coherence='flush' on a shm region: stored in the header, adopted by openers, and the
    ring transfer is exact with the real clwb/clflushopt path."""
    region = _ring_region(f"shm://{name}", coherence="flush")
    try:
        assert region.mem.flushing and region.info().coherence == "flush"
        with Region.open(region.url) as other:
            assert other.coherence == "flush" and other.mem.flushing
        assert _transfer(region.url) == (f"ok {COUNT}", f"ok {COUNT}")
    finally:
        region.unlink()
        region.close()


def test_hardware_mode_is_the_default_and_costs_nothing(url):
    region = _ring_region(url)
    try:
        assert region.coherence == "hardware" and not region.mem.flushing
    finally:
        region.unlink()
        region.close()
