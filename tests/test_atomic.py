"""cxlrpc._atomic, the project's atomic u64 module: exact across processes, the memory orders
it accepts and refuses, bounds and alignment refused with ValueError, no access after close
(checked in a child process, where a touch of unmapped memory would be a signal death), and a
cell doing exactly what its view does at its offset."""
from __future__ import annotations

import mmap
import multiprocessing
import random
import subprocess
import sys
import textwrap
import time

import pytest

from cxlrpc import _atomic, memory
from cxlrpc._atomic import ACQ_REL, ACQUIRE, RELAXED, RELEASE, SEQ_CST, AtomicU64, AtomicView

ORDERS = (RELAXED, ACQUIRE, RELEASE, ACQ_REL, SEQ_CST)
LOAD_ORDERS = (RELAXED, ACQUIRE, SEQ_CST)
STORE_ORDERS = (RELAXED, RELEASE, SEQ_CST)
N = 100_000
JOIN_TIMEOUT = 120.0
READY, GO = 64, 72  # words of the start line: workers ready, and the go


def _start_line(v: AtomicView) -> None:
    """Report ready, then spin until all are (so the workers' loops overlap), with a deadline."""
    v.fetch_add_u64(READY, 1)
    deadline = time.monotonic() + JOIN_TIMEOUT
    while not v.load_u64(GO, ACQUIRE):
        assert time.monotonic() < deadline


def _fetch_adder(buf: mmap.mmap, n: int) -> None:
    with AtomicView(buf) as v:
        _start_line(v)
        for i in range(n):
            v.fetch_add_u64(0, 1, ORDERS[i % 5])


def _cas_incrementer(buf: mmap.mmap, n: int) -> None:
    with AtomicView(buf) as v:
        cell = v.cell_u64(8)
        _start_line(v)
        for _ in range(n):
            seen = cell.load(RELAXED)
            while (prev := cell.cas(seen, seen + 1, ACQ_REL, ACQUIRE)) != seen:
                seen = prev


def _run_all(procs: list[multiprocessing.Process], v: AtomicView) -> None:
    """Start every process, let them go together, join (with a deadline) and, whatever
    happens, end every one."""
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT
        while v.load_u64(READY) < len(procs):
            assert time.monotonic() < deadline and all(p.exitcode is None for p in procs)
            time.sleep(0.001)
        v.store_u64(GO, 1, RELEASE)
        for p in procs:
            p.join(JOIN_TIMEOUT)
            assert p.exitcode == 0, f"worker ended with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def test_fetch_add_and_cas_are_exact_across_processes():
    """Three processes fetch_add one word and three CAS-increment another, N times each, all at
    once: no increment is lost."""
    ctx = multiprocessing.get_context("fork")
    with mmap.mmap(-1, 4096) as buf:  # anonymous and shared: the forked children see it
        workers = [ctx.Process(target=_fetch_adder, args=(buf, N)) for _ in range(3)]
        workers += [ctx.Process(target=_cas_incrementer, args=(buf, N)) for _ in range(3)]
        with AtomicView(buf) as v:
            _run_all(workers, v)
            assert v.load_u64(0) == 3 * N
            assert v.load_u64(8) == 3 * N
            assert v.load_u64(16) == 0  # nothing strayed next door


def test_every_operation_takes_the_orders_it_may_and_refuses_the_others():
    with AtomicView(bytearray(64)) as v:
        cell = v.cell_u64(8)
        for o in ORDERS:
            ok_load, ok_store = o in LOAD_ORDERS, o in STORE_ORDERS
            for load in (lambda: v.load_u64(8, o), lambda: cell.load(o)):
                if ok_load:
                    assert load() == v.load_u64(8)
                else:
                    with pytest.raises(ValueError, match="not a valid memory order"):
                        load()
            for store in (lambda: v.store_u64(8, o + 10, o), lambda: cell.store(o + 10, o)):
                if ok_store:
                    store()
                    assert v.load_u64(8) == o + 10
                else:
                    with pytest.raises(ValueError, match="not a valid memory order"):
                        store()
            before = v.load_u64(8)
            assert cell.fetch_add(1, o) == before and v.fetch_add_u64(8, 1, o) == before + 1
            assert cell.exchange(7, o) == before + 2 and v.exchange_u64(8, 9, o) == 7
            assert v.cas_u64(8, 9, 11, o) == 9 and cell.cas(0, 1, o) == 11  # previous, both ways
            for fail in LOAD_ORDERS:
                assert cell.cas(11, 12, o, fail) == 11 and v.cas_u64(8, 12, 11, o, fail) == 12
            for fail in (RELEASE, ACQ_REL):
                with pytest.raises(ValueError, match="not a valid memory order"):
                    cell.cas(11, 12, o, fail)
            _atomic.fence(o)
        _atomic.fence()
        for bad in (-1, 5, 1 << 40):
            with pytest.raises(ValueError):
                v.load_u64(8, bad)
            with pytest.raises(ValueError):
                cell.fetch_add(1, bad)
            with pytest.raises(ValueError):
                _atomic.fence(bad)
        assert v.load_u64(8) == 11  # the refused calls changed nothing


def test_offsets_outside_the_buffer_or_unaligned_are_refused():
    buf = bytearray(64)
    with AtomicView(buf) as v:
        aligned = v.address % 8 == 0
        assert aligned  # a bytearray's storage is 8-aligned at least
        for off in (-8, -1, 57, 60, 64, 1 << 40, 3, 4):
            for op in (lambda: v.load_u64(off), lambda: v.store_u64(off, 1), lambda: v.cas_u64(off, 0, 1),
                       lambda: v.fetch_add_u64(off, 1), lambda: v.exchange_u64(off, 1),
                       lambda: v.cell_u64(off), lambda: AtomicU64(v, off)):
                with pytest.raises(ValueError):
                    op()
        with pytest.raises(OverflowError):
            v.load_u64(1 << 70)
        with pytest.raises(TypeError):
            v.load_u64(8.0)
        for value in (1 << 64, -(1 << 63) - 1):
            with pytest.raises(OverflowError):
                v.store_u64(0, value)
        assert v.load_u64(56) == 0 and bytes(buf) == bytes(64)  # nothing was written
        v.store_u64(0, -1)  # negative values wrap: results are unsigned
        assert v.load_u64(0) == (1 << 64) - 1 and v.fetch_add_u64(0, 1) == (1 << 64) - 1 and v.load_u64(0) == 0
    with AtomicView(memoryview(bytearray(65))[1:]) as odd:  # the check is on the address
        with pytest.raises(ValueError, match="aligned"):
            odd.load_u64(0)
        assert odd.load_u64(7) == 0
    with pytest.raises((TypeError, BufferError)):
        AtomicView(b"read-only")
    with pytest.raises((TypeError, BufferError)):
        AtomicView(memoryview(bytearray(64))[::2])
    with AtomicView(bytearray()) as empty:
        with pytest.raises(ValueError):
            empty.load_u64(0)


def test_the_view_holds_the_buffer_until_closed():
    buf, m = bytearray(64), mmap.mmap(-1, 4096)
    v, w = AtomicView(buf), AtomicView(m)
    with pytest.raises(BufferError):
        buf.append(0)
    with pytest.raises(BufferError):
        m.close()
    v.close(), w.close(), v.close()  # idempotent
    buf.append(0)
    m.close()
    assert v.closed and v.nbytes == 0


USE_AFTER_CLOSE = textwrap.dedent("""
    import mmap, sys
    from cxlrpc._atomic import AtomicView, AtomicU64, SEQ_CST

    def refused(op):
        try:
            op()
        except ValueError:
            return
        sys.exit(f"not refused: {op}")

    m = mmap.mmap(-1, 1 << 20)
    v = AtomicView(m)
    cell = v.cell_u64(8)
    cell.store(5)
    v.close()
    m.close()  # unmapped: any access now would kill this process with SIGSEGV
    for op in (lambda: v.load_u64(8), lambda: v.store_u64(8, 1), lambda: v.cas_u64(8, 0, 1),
               lambda: v.fetch_add_u64(8, 1), lambda: v.exchange_u64(8, 1), lambda: v.cell_u64(8),
               lambda: v.address, lambda: cell.load(), lambda: cell.store(1), lambda: cell.cas(5, 6),
               lambda: cell.fetch_add(1), lambda: cell.exchange(1), lambda: cell.address,
               lambda: AtomicU64(v, 8)):
        refused(op)
    assert cell.view is v and cell.offset == 8 and "closed" in repr(cell)

    class Closer:  # an argument whose conversion closes the view and unmaps its memory
        def __init__(self, view, mapping):
            self.view, self.mapping = view, mapping
        def __index__(self):
            self.view.close()
            self.mapping.close()
            return SEQ_CST
    for make in (lambda v, m: (lambda: v.fetch_add_u64(8, Closer(v, m)), 0),
                 lambda v, m: (lambda: v.cell_u64(8).store(Closer(v, m)), 0),
                 lambda v, m: (lambda: v.load_u64(8, Closer(v, m)), 0)):
        m = mmap.mmap(-1, 1 << 20)
        v = AtomicView(m)
        op, _ = make(v, m)
        refused(op)
    print("ok")
""")


def test_use_after_close_raises_and_never_touches_the_memory():
    """In a child: after close (and the mapping unmapped) every operation of the view and of
    its cells raises ValueError, also when an argument's __index__ closes the view mid-call."""
    proc = subprocess.run([sys.executable, "-c", USE_AFTER_CLOSE], capture_output=True, text=True,
                          timeout=JOIN_TIMEOUT)
    assert proc.returncode == 0, f"child ended with {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "ok"


def test_a_cell_does_what_its_view_does_at_its_offset():
    rnd = random.Random(41)
    values = (0, 1, 7, (1 << 63), (1 << 64) - 1, -1, -(1 << 63), 1 << 32)
    a, b = bytearray(64), bytearray(64)
    with AtomicView(a) as va, AtomicView(b) as vb:
        cell = vb.cell_u64(16)
        assert (cell.address - vb.address, cell.offset, cell.view) == (16, 16, vb)
        assert type(cell) is memory.Counter
        for _ in range(5000):
            op, o = rnd.choice(("load", "store", "cas", "fetch_add", "exchange")), rnd.choice(ORDERS)
            args = {"load": (), "store": (rnd.choice(values),), "cas": (rnd.choice(values), rnd.choice(values)),
                    "fetch_add": (rnd.choice(values),), "exchange": (rnd.choice(values),)}[op]
            results = []
            for call in (lambda: getattr(va, f"{op}_u64")(16, *args, o), lambda: getattr(cell, op)(*args, o)):
                try:
                    results.append(call())
                except ValueError as e:
                    results.append(str(e))
            assert results[0] == results[1], (op, args, o)
        assert a == b


def test_atomic_memory_counters_refuse_use_after_the_memory_closes():
    mem = memory.AtomicMemory(bytearray(256))
    counter = mem.counter(64)
    counter.store(3)
    assert mem.load(64) == 3 and mem.fetch_add(64, 2) == 3 and mem.cas(64, 5, 9) == 5 and mem.exchange(64, 1) == 9
    mem.close()
    with pytest.raises(ValueError):
        counter.load()
    with pytest.raises(ValueError):
        mem.load(64)
