"""Big bodies in flush mode, in one pass each way (cxlrpc.heap.FLUSH_HEAP_MIN): written into the
heap with streaming stores (``Lines.write_body``, site BODY_WRITE) and copied out a chunk at a time,
each chunk invalidated right before it is copied (``Lines.read_body``, site BODY_READ).

Across processes on ``sim://`` (each process its own cache): bodies of 64 KiB, 1 MiB and odd sizes,
both directions, exact with random evictions and without; removing either site in either process
(``Lines.skip``, evictions off) breaks the scenario; and the flush count of each call's bodies is
exactly what the protocol asks (one write-back and fence per body written, one invalidate and fence
per chunk read, every line of the body once)."""
from __future__ import annotations

import asyncio
import mmap
import os

import pytest

import cxlrpc
from cxlrpc import simulator
from cxlrpc.heap import FLUSH_HEAP_MIN
from cxlrpc.memory import _native
from procs import CTX

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(_native is None, reason="cxlrpc._flush was not built (no C compiler)")]

KiB, MiB = 1 << 10, 1 << 20
LINE = 64
#: body sizes that go through the heap (and one just below, through the ring)
SIZES = (64 * KiB, MiB, 64 * KiB + 1, 300_001, MiB + 13, 3 * MiB - 7)
SITES = {name: number for number, (name, _) in enumerate(_native.sites())} if _native else {}


def _record_heap_flushes(into: list, span: list) -> None:
    """Make this process's simulated caches note each write-back and invalidate of the lines in
    ``span`` ([start, end) of the region: its heap), as ("wb" | "inv", offset, length)."""
    writeback, invalidate = simulator.CacheSim.writeback, simulator.CacheSim.invalidate

    def noted(kind: str, fn):
        def hook(self, offset: int, length: int) -> None:
            if span and span[0] <= offset < span[1]:
                into.append((kind, offset, length))
            fn(self, offset, length)
        return hook

    simulator.CacheSim.writeback = noted("wb", writeback)  # type: ignore[method-assign]
    simulator.CacheSim.invalidate = noted("inv", invalidate)  # type: ignore[method-assign]


def _serve(url: str, eviction: float | None, skip: int, ready, done) -> None:
    """Server process on ``url``: echo, digest (a big request), make (a big reply) and its own
    heap flushes since it was last asked; ``skip``: a flush site its Lines leaves out."""
    import hashlib

    if eviction is not None:
        simulator.EVICTION_RATE = eviction
    noted: list = []
    span: list = []
    _record_heap_flushes(noted, span)

    async def main() -> None:
        server = cxlrpc.Server(url, slots=2, coherence="flush", max_message_size=4 * MiB,
                               heap_size=16 * MiB, request_capacity=1 * MiB, response_capacity=4 * MiB, client_timeout=5.0)

        @server.method("echo")
        async def echo(payload: bytes) -> bytes:
            return payload

        @server.method("digest")
        async def digest(payload: bytes) -> bytes:
            return hashlib.sha256(payload).digest()

        @server.method("make")
        async def make(how: list) -> bytes:
            return hashlib.shake_256(bytes([how[1]])).digest(how[0])

        @server.method("flushes")
        def flushes(_: bytes) -> list:
            out = [list(n) for n in noted]
            noted.clear()
            return out

        async with server:
            geo = server.geometry
            span[:] = [geo.heap, geo.heap + geo.heap_size]
            server._region.mem.lines.skip = skip
            ready.set()
            await asyncio.to_thread(done.wait, 170)

    cxlrpc.run(main())


class _Peer:
    """A server process for one test, ended (and its region unlinked) on exit."""

    def __init__(self, url: str, eviction: float | None, skip: int = 0) -> None:
        self.ready, self.done = CTX.Event(), CTX.Event()
        self.proc = CTX.Process(target=_serve, args=(url, eviction, skip, self.ready, self.done), daemon=True)

    async def __aenter__(self) -> "_Peer":
        self.proc.start()
        assert await asyncio.to_thread(self.ready.wait, 60), "server did not start"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.done.set()
        await asyncio.to_thread(self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 10)


async def _scenario(client: cxlrpc.Client) -> None:
    """Every size each way, twice (the second time into extents that held other bytes: a
    request's spare, a reply's parked extent), and one just below FLUSH_HEAP_MIN."""
    import hashlib

    for size in (*SIZES, *SIZES, FLUSH_HEAP_MIN - 1):
        payload = os.urandom(size)
        assert await client.call("echo", payload, timeout=20) == payload, f"echo of {size}"
        assert await client.call("digest", payload, timeout=20) == hashlib.sha256(payload).digest(), \
            f"request of {size}"
        tag = payload[0]
        assert await client.call("make", [size, tag], timeout=20) == hashlib.shake_256(bytes([tag])).digest(size), \
            f"reply of {size}"


@pytest.mark.parametrize("eviction", [None, 0.0], ids=["evictions", "no-evictions"])
async def test_big_bodies_are_exact_across_processes(name, eviction, monkeypatch):
    if eviction is not None:
        monkeypatch.setattr(simulator, "EVICTION_RATE", eviction)
    url = f"sim://{name}"
    async with _Peer(url, eviction):
        async with cxlrpc.connect(url) as client:
            await _scenario(client)
            payload = os.urandom(64 * KiB)
            assert await client.call("echo", payload, timeout=20) == payload
            assert client._bodies.spare is not None  # (requests go through an extent kept for the next)


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("site", ["BODY_WRITE", "BODY_READ"])
async def test_removing_a_body_site_breaks_the_scenario(name, site, side, monkeypatch):
    """Each BODY_* site left out (Lines.skip) in the process that owns it, no evictions to
    hide it: some body arrives wrong. (skip 0 is test_big_bodies_are_exact_across_processes's
    no-evictions case.)"""
    assert set(s for s in SITES if s.startswith("BODY_")) == {"BODY_WRITE", "BODY_READ"}
    monkeypatch.setattr(simulator, "EVICTION_RATE", 0.0)
    url = f"sim://{name}"
    async with _Peer(url, 0.0, SITES[site] if side == "server" else 0):
        async with cxlrpc.connect(url) as client:
            if side == "client":
                client._conn.chan.region.mem.lines.skip = SITES[site]
            try:
                await _scenario(client)
                ok = True
            except (AssertionError, cxlrpc.RpcError):
                ok = False
    assert not ok, f"leaving {site} out in the {side} went unnoticed"


def _expected(size: int, chunk: int) -> tuple[list[int], list[int]]:
    """The lengths of the write-back calls and of the invalidate calls one body of ``size``
    costs its writer and its reader: one write-back of the whole body; one invalidate per chunk."""
    return [size], [min(chunk, size - done) for done in range(0, size, chunk)]


async def test_flush_counts_per_call(name, monkeypatch):
    """The heap lines each side writes back and invalidates per echo of 64 KiB, 1 MiB and an
    odd size, counted over the simulator's hooks (exact: the protocol's, nothing else touches
    the heap in flush mode)."""
    monkeypatch.setattr(simulator, "EVICTION_RATE", 0.0)
    noted: list = []
    span: list = []
    url = f"sim://{name}"
    with monkeypatch.context() as m:
        m.setattr(simulator.CacheSim, "writeback", simulator.CacheSim.writeback)
        m.setattr(simulator.CacheSim, "invalidate", simulator.CacheSim.invalidate)
        _record_heap_flushes(noted, span)
        async with _Peer(url, 0.0):
            async with cxlrpc.connect(url) as client:
                geo = client._conn.chan.geo
                span[:] = [geo.heap, geo.heap + geo.heap_size]
                for size in (64 * KiB, MiB, 100_003):
                    payload = os.urandom(size)
                    assert await client.call("echo", payload, timeout=20) == payload  # (the extents exist now)
                    await client.call("flushes", b"", timeout=20)
                    noted.clear()
                    assert await client.call("echo", payload, timeout=20) == payload
                    mine = list(noted)
                    theirs = [tuple(n) for n in await client.call("flushes", b"", timeout=20)]
                    writes, reads = _expected(size, _native.BODY_CHUNK)
                    for who, flushes in (("client", mine), ("server", theirs)):
                        assert [n for k, _, n in flushes if k == "wb"] == writes, (who, size, flushes)
                        assert [n for k, _, n in flushes if k == "inv"] == reads, (who, size, flushes)
                        # the reads' chunks follow each other over one extent
                        starts = [off for k, off, _ in flushes if k == "inv"]
                        assert starts == [starts[0] + i * _native.BODY_CHUNK for i in range(len(reads))]


@pytest.mark.parametrize("size", [64 * KiB, MiB, 100_003])
def test_lines_count_each_body_copy(size):
    """Over real memory (the CPU's instructions): a body written costs one write-back call of
    all its lines and one store fence; a body read, one invalidate and one full fence per
    BODY_CHUNK, every line once; the bytes are exact."""
    m = mmap.mmap(-1, 4 * MiB)
    try:
        import ctypes
        base = ctypes.c_char.from_buffer(m)
        lines = _native.Lines(ctypes.addressof(base), len(m))
        del base
        payload = os.urandom(size)
        lines.write_body(4096, payload)
        n = -(-size // LINE)
        assert lines.counts() == {"writebacks": 1, "invalidates": 0, "fences": 1, "lines": n}
        lines.reset()
        assert lines.read_body(4096, size) == payload
        chunks = -(-size // _native.BODY_CHUNK)
        assert lines.counts() == {"writebacks": 0, "invalidates": chunks, "fences": chunks, "lines": n}
        assert m[4096:4096 + size] == payload
        lines.write_body(4096 + 7, payload[:1000])  # partial lines at either end
        assert lines.read_body(4096 + 7, 1000) == payload[:1000]
        with pytest.raises(ValueError):
            lines.read_body(len(m) - 10, 11)
        with pytest.raises(ValueError):
            lines.write_body(len(m) - 10, b"x" * 11)
        lines.close()
        with pytest.raises(ValueError):
            lines.read_body(0, 1)
        with pytest.raises(ValueError):
            lines.write_body(0, b"x")
    finally:
        m.close()
