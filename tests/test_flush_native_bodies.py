"""Big bodies in flush mode, in one pass each way (cxlrpc.heap): a body too big for its ring is
written into the heap with streaming stores (``Lines.write_body``, site BODY_WRITE) and copied out
a chunk at a time, each chunk invalidated right before it is copied (``Lines.read_body``, site
BODY_READ); bodies from FOLLOW_MIN are followed, both ways (``cxlrpc._flush.publish_flushed`` /
``follow_flushed`` / ``Follower.step_flushed``, sites FOLLOW_*).

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
from cxlrpc.heap import FOLLOW_MIN
from cxlrpc.memory import _native
from procs import CTX

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(_native is None, reason="cxlrpc._flush was not built (no C compiler)")]

KiB, MiB = 1 << 10, 1 << 20
LINE = 64
#: the servers' rings: 256 KiB, whose records hold up to 128 KiB (smaller bodies go through them)
RING = 256 * KiB
#: body sizes through the heap: whole (over the ring's limit, under FOLLOW_MIN) and followed
SIZES = (150_000, 200 * KiB + 1, MiB, 300_001, MiB + 13, 3 * MiB - 7)
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
                               heap_size=16 * MiB, request_capacity=RING, response_capacity=RING, client_timeout=5.0)

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
    request's spare, a reply's parked extent), and one through the rings. A request alone is
    big first, then a reply alone, then both (an echo whose reply reuses its request's extent
    would hide a request never written back: its reader's invalidate writes the writer's dirty
    lines back first, as clflushopt does)."""
    import hashlib

    for size in (*SIZES, *SIZES, 64 * KiB):
        payload = os.urandom(size)
        assert await client.call("digest", payload, timeout=20) == hashlib.sha256(payload).digest(), \
            f"request of {size}"
        tag = payload[0]
        assert await client.call("make", [size, tag], timeout=20) == hashlib.shake_256(bytes([tag])).digest(size), \
            f"reply of {size}"
        assert await client.call("echo", payload, timeout=20) == payload, f"echo of {size}"


@pytest.mark.parametrize("eviction", [None, 0.0], ids=["evictions", "no-evictions"])
async def test_big_bodies_are_exact_across_processes(name, eviction, monkeypatch):
    if eviction is not None:
        monkeypatch.setattr(simulator, "EVICTION_RATE", eviction)
    url = f"sim://{name}"
    async with _Peer(url, eviction):
        async with cxlrpc.connect(url) as client:
            await _scenario(client)
            payload = os.urandom(MiB)
            assert await client.call("echo", payload, timeout=20) == payload
            assert client._bodies.spare is not None  # (followed requests go through an extent kept for the next)


#: (site, a process that owns it here): each side writes and reads bodies (a request's writer is
#: the client, a reply's the server), whole below FOLLOW_MIN (BODY_*), followed from it (FOLLOW_*)
OWNED = [(site, side) for site in ("BODY_WRITE", "BODY_READ", "FOLLOW_WRITE", "FOLLOW_PROGRESS", "FOLLOW_POLL",
                                   "FOLLOW_READ") for side in ("client", "server")]


def test_every_body_site_has_its_mutation_test():
    ours = {s for s in SITES if s.startswith(("BODY_", "FOLLOW_"))}
    assert ours == {site for site, _ in OWNED} | {"FOLLOW_SEAL"}


@pytest.mark.mutations
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


def _check_followed(size: int, flushes: list, who: str, sealed: bool) -> None:
    """A followed body of ``size`` (cxlrpc.heap: without coherence its seal at +8, its progress
    word at +64, its body from +128). Its writer: the zeroed progress word written back, then
    per FOLLOW_CHUNK the chunk's write-back and the progress word's (a sealed extent's writer, a
    client, invalidates the seal's line before that and before each chunk and each progress
    store). Its reader: the progress word's line invalidated at each look, each run of bytes it
    announced once (the body whole, in order), a sealed one's seal line last."""
    from cxlrpc.heap import FLUSH_FOLLOW_HEADER, FLUSH_PROGRESS_AT, SEAL_AT
    from cxlrpc.memory import FOLLOW_CHUNK

    seal = [("inv", SEAL_AT, 8)] if sealed else []
    if who == "writer":
        base = flushes[0][1] - (SEAL_AT if sealed else FLUSH_PROGRESS_AT)
        want = seal + [("wb", FLUSH_PROGRESS_AT, 8)]
        for d in range(0, size, FOLLOW_CHUNK):
            want += seal + [("wb", FLUSH_FOLLOW_HEADER + d, min(FOLLOW_CHUNK, size - d))] + seal + \
                [("wb", FLUSH_PROGRESS_AT, 8)]
        assert [(k, off - base, n) for k, off, n in flushes] == want, flushes
        return
    base = flushes[0][1] - FLUSH_PROGRESS_AT
    got = [(k, off - base, n) for k, off, n in flushes]
    assert {k for k, _, _ in got} == {"inv"}, flushes
    if sealed:
        assert got[-1] == seal[0], flushes
        got = got[:-1]
    polls = [n for _, off, n in got if off == FLUSH_PROGRESS_AT]
    runs = [(off, n) for _, off, n in got if off >= FLUSH_FOLLOW_HEADER]
    assert len(polls) + len(runs) == len(got) and set(polls) == {8} and len(polls) >= len(runs), flushes
    assert [off for off, _ in runs] == [FLUSH_FOLLOW_HEADER + sum(n for _, n in runs[:i]) for i in range(len(runs))]
    assert sum(n for _, n in runs) == size, flushes


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
                for size in (150_000, 200 * KiB, MiB, 300_001):
                    payload = os.urandom(size)
                    assert await client.call("echo", payload, timeout=20) == payload  # (the extents exist now)
                    await client.call("flushes", b"", timeout=20)
                    noted.clear()
                    assert await client.call("echo", payload, timeout=20) == payload
                    mine = list(noted)
                    theirs = [tuple(n) for n in await client.call("flushes", b"", timeout=20)]
                    if size < FOLLOW_MIN:  # whole both ways: each side writes one body, reads the other
                        for flushes in (mine, theirs):
                            _check_whole(size, [f for f in flushes if f[0] == "wb"], "writer")
                            _check_whole(size, [f for f in flushes if f[0] == "inv"], "reader")
                        continue
                    # the request: followed, through the client's spare (sealed: the client checks)
                    spare = client._bodies.spare
                    assert spare is not None
                    ours = range(span[0] + spare[0], span[0] + spare[0] + spare[1])
                    _check_followed(size, [f for f in mine if f[1] in ours], "writer", sealed=True)
                    _check_followed(size, [f for f in theirs if f[0] == "inv"], "reader", sealed=False)
                    # the reply: followed (its writer, the server, checks no seal; its reader does)
                    _check_followed(size, [f for f in theirs if f[0] == "wb"], "writer", sealed=False)
                    _check_followed(size, [f for f in mine if f[1] not in ours], "reader", sealed=True)


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


# ---------------------------------------------------------------- HeapAccess's own flushes
def _heap_accesses(two: _TwoCaches):
    """The server's HeapAccess over the first cache, a client's (its seal SEALED) over the second."""
    from cxlrpc.heap import HeapAccess
    from cxlrpc.memory import AtomicMemory

    out = []
    for sim, seal in zip(two.sims, (None, SEALED)):
        mem = AtomicMemory(sim.cache)
        mem.use_flushes(sim.writeback, sim.invalidate)
        out.append((HeapAccess(memoryview(sim.cache), mem, 0, len(sim.cache), seal), mem))
    return out


def _own_sites() -> list[tuple[str, int, str]]:
    """HeapAccess's flush calls test_heap leaves to this module: (method, line, call)."""
    import inspect

    import cxlrpc.heap as heap
    from test_heap import HEAP_SITES, OWN_SCENARIO
    source = inspect.getsource(heap).splitlines()
    return [(m, n, "invalidate" if ".invalidate(" in source[n - 1] else "writeback")
            for m, n in HEAP_SITES if m in OWN_SCENARIO]


def _held(two: _TwoCaches, server, client, method: str, call: str) -> bool:
    """Run the scenario that needs ``method``'s ``call``: whether the protocol held."""
    from cxlrpc.heap import SEAL_REVOKED
    from cxlrpc.memory import SealBroken

    body = os.urandom(LENGTH)
    two.seal(SEALED)  # (as the server's seal() does, whatever the mutation)
    if (method, call) == ("begin_publish", "invalidate"):  # a client whose seal was taken back
        client.mem.invalidate(0, 64)  # (the client saw its seal: its cache holds the line)
        client.begin_publish(0)
        server.seal(0, SEAL_REVOKED)
        try:
            client.begin_publish(0)
        except SealBroken:
            return True
        return False
    if method == "progress":  # the server looks at an abandoned request's progress
        assert server.progress(0) == 0
        client.begin_publish(0)
        client.publish(0, body)
        return server.progress(0) == LENGTH
    if method == "followed_view":  # a lent body the server only waited for
        client.begin_publish(0)
        client.publish(0, body)
        waited = server.follower(0, LENGTH, copy=False)
        assert waited.step(0.05, 0.5)
        return bytes(server.followed_view(0, LENGTH)) == body
    server.begin_publish(0)
    server.publish(0, body)
    assert client.follow(0, LENGTH) == body
    try:
        if method == "begin_publish":  # the extent reused: the next reply's frame is out now
            server.begin_publish(0)
            client.follow(0, LENGTH)
        elif method == "seal":  # its owner departed
            server.seal(0, SEAL_REVOKED)
            client.follow(0, LENGTH)
        else:  # publish: the writer gave up (a copy that raised)
            server.begin_publish(0)
            with pytest.raises(TypeError):
                server.publish(0, [0] * 16)  # type: ignore[arg-type]
            client.follow(0, 16)
    except TimeoutError:
        return method == "begin_publish"
    except SealBroken:
        return method == "seal"
    except ValueError:
        return method == "publish"
    return False


@pytest.mark.parametrize("mutate", [False, True], ids=["whole", "mutated"])
@pytest.mark.parametrize("site", _own_sites(), ids=[f"{m}:{c}" for m, _, c in _own_sites()])
def test_heap_access_flushes_between_two_caches(caches, monkeypatch, site, mutate):
    """HeapAccess's write-backs and invalidates that test_heap's one-process scenario cannot
    show (there the progress word's stores write the same line back): the zeroed progress word
    (else a reused extent's reader takes the last body for the new one), the seal and its check
    (else a client goes on with an extent no longer its own), a given-up writer's progress (else
    its reader waits out the stall), an abandoned request's progress and a lent followed body (else
    the server reads its own stale lines). Each holds whole and fails with its call removed."""
    from cxlrpc import heap
    from test_heap import mutated

    monkeypatch.setattr(heap, "FOLLOW_STALL_S", 0.05)
    if mutate:
        monkeypatch.setattr(heap.HeapAccess, site[0], mutated(site[:2]))
    (server, smem), (client, cmem) = _heap_accesses(caches)
    try:
        assert _held(caches, server, client, site[0], site[2]) != mutate
    finally:
        smem.close()
        cmem.close()
