"""Big bodies in flush mode, in one pass each way (cxlrpc.heap.FLUSH_HEAP_MIN): written into the
heap with streaming stores (``Lines.write_body``, site BODY_WRITE) and copied out a chunk at a time,
each chunk invalidated right before it is copied (``Lines.read_body``, site BODY_READ); replies from
FOLLOW_MIN followed (``cxlrpc._flush.publish_flushed`` / ``follow_flushed``, sites FOLLOW_*).

Across processes on ``sim://`` (each process its own cache): bodies of 64 KiB, 1 MiB and odd sizes,
both directions, exact with random evictions and without; removing any of those sites in the
process that owns it (``Lines.skip``, evictions off) breaks the scenario (FOLLOW_SEAL, which the
progress word's invalidate masks there, in a two-cache scenario of its own); and the flush count of
each call's bodies is what the protocol asks (one write-back and fence per body written, one
invalidate and fence per chunk read, every line of the body once; per chunk of a followed body, its
write-back and the progress word's)."""
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


#: (site, the process that owns it here): the writer of a request's body is the client, of a
#: reply's the server (followed replies only: requests are not followed without coherence)
OWNED = [("BODY_WRITE", "client"), ("BODY_WRITE", "server"), ("BODY_READ", "client"), ("BODY_READ", "server"),
         ("FOLLOW_WRITE", "server"), ("FOLLOW_PROGRESS", "server"), ("FOLLOW_POLL", "client"),
         ("FOLLOW_READ", "client")]


def test_every_body_site_has_its_mutation_test():
    ours = {s for s in SITES if s.startswith(("BODY_", "FOLLOW_"))}
    assert ours == {site for site, _ in OWNED} | {"FOLLOW_SEAL"}


@pytest.mark.parametrize("site,side", OWNED, ids=[f"{s}-{p}" for s, p in OWNED])
async def test_removing_a_body_site_breaks_the_scenario(name, site, side, monkeypatch):
    """Each site left out (Lines.skip) in the process that owns it, no evictions to hide it:
    some body arrives wrong, or a followed one never arrives (Unavailable). (skip 0 is
    test_big_bodies_are_exact_across_processes's no-evictions case.)"""
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


def _check_whole(size: int, flushes: list, who: str) -> None:
    """A body of ``size`` through the heap whole: its writer's one write-back of it all; its
    reader's one invalidate per BODY_CHUNK, over the body in order."""
    chunk = _native.BODY_CHUNK
    writes = [n for k, _, n in flushes if k == "wb"]
    reads = [(off, n) for k, off, n in flushes if k == "inv"]
    if who == "writer":
        assert writes == [size] and reads == [], flushes
    else:
        assert writes == [] and [n for _, n in reads] == [min(chunk, size - d) for d in range(0, size, chunk)], flushes
        assert [off for off, _ in reads] == [reads[0][0] + d for d in range(0, size, chunk)], flushes


def _check_followed(size: int, flushes: list, who: str) -> None:
    """A followed body of ``size``: its writer's write-back of the zeroed progress word, then per
    FOLLOW_CHUNK the chunk's and the progress word's; its reader's invalidates of the progress
    word (each look), of each run of bytes it announced (the body once, in order) and last of the
    seal (one line each)."""
    from cxlrpc.heap import FOLLOW_HEADER, SEAL_AT
    from cxlrpc.memory import FOLLOW_CHUNK

    if who == "writer":
        chunks = [min(FOLLOW_CHUNK, size - d) for d in range(0, size, FOLLOW_CHUNK)]
        assert [k for k, _, _ in flushes] == ["wb"] * (1 + 2 * len(chunks)), flushes
        assert [n for _, _, n in flushes] == [8] + [n for c in chunks for n in (c, 8)], flushes
        return
    assert {k for k, _, _ in flushes} == {"inv"}, flushes
    at = flushes[0][1]  # (the first look at the progress word: the extent's start)
    polls = [n for _, off, n in flushes if off == at]
    runs = [(off, n) for _, off, n in flushes if off >= at + FOLLOW_HEADER]
    assert polls and set(polls) == {8} and len(polls) >= len(runs), flushes
    assert sum(n for _, n in runs) == size and [off for off, _ in runs] == \
        [at + FOLLOW_HEADER + sum(n for _, n in runs[:i]) for i in range(len(runs))], flushes
    assert flushes[-1][1:] == (at + SEAL_AT, 8), flushes


async def test_flush_counts_per_call(name, monkeypatch):
    """The heap lines each side writes back and invalidates per echo of 64 KiB, 1 MiB and an
    odd size, counted over the simulator's hooks (nothing else touches the heap in flush mode):
    exact where the protocol fixes them (a followed body's reader looks at the progress word as
    often as it must wait)."""
    from cxlrpc.heap import FOLLOW_MIN

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
                    # the request: written whole by the client, read by the server
                    _check_whole(size, [f for f in mine if f[0] == "wb"], "writer")
                    _check_whole(size, [f for f in theirs if f[0] == "inv"], "reader")
                    # the reply: followed from FOLLOW_MIN, else whole
                    reply = _check_followed if size >= FOLLOW_MIN else _check_whole
                    reply(size, [f for f in theirs if f[0] == "wb"], "writer")
                    reply(size, [f for f in mine if f[0] == "inv"], "reader")


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


# ---------------------------------------------------------------- a followed body, two caches
BODY_AT, LENGTH = 64, 3 * (64 * KiB) + 100  # (FOLLOW_HEADER; three FOLLOW_CHUNKs and a bit)
SEALED = 0x1234_5679


def _address(m: mmap.mmap) -> int:
    import ctypes
    view = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(view)
    finally:
        del view


class _TwoCaches:
    """A writer's and a reader's cache over one memory (two CacheSims, no evictions), each
    with its Lines; the reader's invalidate hook may run ``on_read`` first."""

    def __init__(self, size: int = MiB) -> None:
        fd = os.memfd_create("cxlrpc-test-two-caches")
        try:
            os.ftruncate(fd, size)
            self.sims = [simulator.CacheSim(mmap.mmap(fd, size), eviction_rate=0.0) for _ in range(2)]
        finally:
            os.close(fd)
        self.on_read = None
        w, r = self.sims

        def reader_invalidate(offset: int, length: int) -> None:
            if self.on_read is not None and offset >= BODY_AT:
                self.on_read()
            r.invalidate(offset, length)

        self.writer = _native.Lines(_address(w.cache), size, w.writeback, w.invalidate)
        self.reader = _native.Lines(_address(r.cache), size, r.writeback, reader_invalidate)

    def seal(self, word: int) -> None:
        """The writer's cache stores the seal and writes it back (as the server does)."""
        w = self.sims[0]
        w.cache[8:16] = word.to_bytes(8, "little")
        w.writeback(8, 8)

    def close(self) -> None:
        self.writer.close()
        self.reader.close()
        for sim in self.sims:
            sim.close()


@pytest.fixture
def caches():
    two = _TwoCaches()
    yield two
    two.close()


def _publish_then_follow(two: _TwoCaches, body: bytes):
    assert _native.publish_flushed(two.writer, BODY_AT, body, 0, 64 * KiB)
    return _native.follow_flushed(two.reader, BODY_AT, len(body), 0, 0.05, 0.2, 8, SEALED)


@pytest.mark.parametrize("site,side", [("NONE", ""), ("FOLLOW_WRITE", "writer"), ("FOLLOW_PROGRESS", "writer"),
                                       ("FOLLOW_POLL", "reader"), ("FOLLOW_READ", "reader")])
def test_a_followed_body_between_two_caches(caches, site, side):
    """Exact with every site; with one left out, wrong bytes (a write or a read not flushed)
    or none (the progress word never seen: None, the writer given up)."""
    caches.seal(SEALED)
    if site != "NONE":
        setattr(getattr(caches, side), "skip", SITES[site])
    body = os.urandom(LENGTH)
    got = _publish_then_follow(caches, body)
    assert (got == body) == (site == "NONE"), (site, None if got is None else len(got))


@pytest.mark.parametrize("skip", [False, True])
def test_a_seal_revoked_while_the_body_is_copied_is_seen(caches, skip):
    """The seal taken back while the reader copies (its line re-read from memory after the copy:
    FOLLOW_SEAL) makes the copy void (False); without that invalidate the stale seal passes."""
    caches.seal(SEALED)
    caches.on_read = lambda: caches.seal(0)
    if skip:
        caches.reader.skip = SITES["FOLLOW_SEAL"]
    body = os.urandom(LENGTH)
    got = _publish_then_follow(caches, body)
    assert (got == body) if skip else (got is False)


def test_a_writer_whose_seal_is_not_its_own_writes_nothing(caches):
    caches.seal(SEALED + 2)
    assert _native.publish_flushed(caches.writer, BODY_AT, b"x" * LENGTH, 0, 64 * KiB, 8, SEALED) is False
    assert bytes(caches.sims[1].memory[BODY_AT:BODY_AT + 64]) == bytes(64)
    assert _native.publish_flushed(caches.writer, BODY_AT, b"x" * LENGTH, 0, 64 * KiB, 8, SEALED + 2) is True


def test_followed_flush_counts_over_real_memory():
    """Over the CPU's instructions: per chunk written, its write-back and the progress word's
    (one store fence: the chunk's, before the progress store); a reader that finds the body
    whole looks once, invalidates it in one run and the seal's line: two lines more, a fence each."""
    m = mmap.mmap(-1, MiB)
    try:
        lines = _native.Lines(_address(m), len(m))
        m[8:16] = SEALED.to_bytes(8, "little")
        body = os.urandom(LENGTH)
        assert _native.publish_flushed(lines, BODY_AT, body, 0, 64 * KiB)
        chunks = -(-LENGTH // (64 * KiB))
        body_lines = -(-LENGTH // LINE)
        assert lines.counts() == {"writebacks": 2 * chunks, "invalidates": 0, "fences": chunks,
                                  "lines": body_lines + chunks}
        lines.reset()
        assert _native.follow_flushed(lines, BODY_AT, LENGTH, 0, 1.0, 1.0, 8, SEALED) == body
        assert lines.counts() == {"writebacks": 0, "invalidates": 3, "fences": 3, "lines": body_lines + 2}
        with pytest.raises(ValueError):
            _native.follow_flushed(lines, len(m) - 10, 11, 0, 1.0, 1.0)
        m[0:8] = (LENGTH + 1).to_bytes(8, "little")
        with pytest.raises(ValueError, match="outside"):
            _native.follow_flushed(lines, BODY_AT, LENGTH, 0, 1.0, 1.0)
        lines.close()
    finally:
        m.close()


# ---------------------------------------------------------------- HeapAccess's own write-backs
def _heap_accesses(two: _TwoCaches):
    """The server's HeapAccess over the writer's cache, a client's (its seal SEALED) over the reader's."""
    from cxlrpc.heap import HeapAccess
    from cxlrpc.memory import AtomicMemory

    out = []
    for sim, seal in zip(two.sims, (None, SEALED)):
        mem = AtomicMemory(sim.cache)
        mem.use_flushes(sim.writeback, sim.invalidate)
        out.append((HeapAccess(memoryview(sim.cache), mem, 0, len(sim.cache), seal), mem))
    return out


def _heap_site(method: str):
    from test_heap import HEAP_SITES
    (site,) = [s for s in HEAP_SITES if s[0] == method]
    return site


@pytest.mark.parametrize("mutate", [False, True], ids=["whole", "mutated"])
@pytest.mark.parametrize("method", ["begin_publish", "seal"])
def test_a_reused_extent_is_not_read_stale(caches, monkeypatch, method, mutate):
    """A parked extent followed again: its zeroed progress word written back before the frame
    (else the reader takes the last body's progress, and its bytes, for the new one's); its seal
    taken back and written back (else a reader of an extent no longer its own passes the check)."""
    from cxlrpc import heap
    from cxlrpc.heap import SEAL_REVOKED
    from cxlrpc.memory import SealBroken
    from test_heap import mutated

    monkeypatch.setattr(heap, "FOLLOW_STALL_S", 0.05)
    if mutate:
        monkeypatch.setattr(heap.HeapAccess, method, mutated(_heap_site(method)))
    (server, smem), (client, cmem) = _heap_accesses(caches)
    try:
        first = os.urandom(LENGTH)
        server.seal(0, SEALED)
        server.begin_publish(0)
        server.publish(0, first)
        assert client.follow(0, LENGTH) == first
        try:
            if method == "begin_publish":
                server.begin_publish(0)  # the next reply's frame would be pushed now
                with pytest.raises(TimeoutError):
                    client.follow(0, LENGTH)
            else:
                server.seal(0, SEAL_REVOKED)  # its owner departed
                with pytest.raises(SealBroken):
                    client.follow(0, LENGTH)
            caught = True
        except pytest.fail.Exception:
            caught = False
        assert caught != mutate, f"removing {method}'s write-back went unnoticed" if mutate else "failed whole"
    finally:
        smem.close()
        cmem.close()
