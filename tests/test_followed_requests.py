"""Followed requests (cxlrpc.heap): a unary call's big body is written into its heap extent
after its frame goes out, while the server copies it out a step at a time between its other
work. Exact around the threshold for bytes, typed and lent handlers, blocking and asyncio
clients, native and reference copies. A client that stops writing, fails mid-copy, gives up
or leaves gets the server to free its extent and never holds up the server's other callers;
garbage is refused; memory without coherence and one-way calls keep the plain way; a method
that reads its body in place stops being followed."""
from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from typing import Any

import pytest

import cxlrpc
import cxlrpc.heap
import cxlrpc.server_bodies
from cxlrpc import frame as fr
from cxlrpc import memory
from cxlrpc.client_connection import Connection
from cxlrpc.client_replies import Replies
from cxlrpc.heap import EXTENT, FOLLOW_HEADER, FOLLOW_MIN, GRANT, HeapAccess, ServerHeap
from cxlrpc.memory import FOLLOW_CHUNK, AtomicMemory, FollowedBody, publish_copy
from cxlrpc.server_bodies import Bodies

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20
SIZES = (FOLLOW_MIN - 1, FOLLOW_MIN, FOLLOW_MIN + 1, 5 * FOLLOW_CHUNK + 7, MiB + 13, 3 * MiB)
FOLLOWED = [s for s in SIZES if s >= FOLLOW_MIN]


@pytest.fixture
def followed(monkeypatch) -> list[tuple[str, int]]:
    """(method, body length) of each request the server followed (Bodies.follow_request
    spied on)."""
    seen: list[tuple[str, int]] = []
    real = Bodies.follow_request

    def spy(self, f):
        seen.append((f.method, EXTENT.unpack(bytes(f.body))[1]))
        return real(self, f)

    monkeypatch.setattr(Bodies, "follow_request", spy)
    return seen


def _server(url: str, **opts) -> cxlrpc.Server:
    server = cxlrpc.Server(url, **opts)

    @server.method("echo")
    async def echo(payload: bytes) -> bytes:
        return payload

    @server.method("digest")
    def digest(payload: bytes) -> str:
        return hashlib.sha256(payload).hexdigest()

    @server.method("total")
    def total(numbers: list[int]) -> int:  # a MessagePack body, decoded once whole
        return sum(numbers)

    @server.method("echo_view")
    def echo_view(payload: memoryview) -> memoryview:  # reads its body in place
        return payload

    @server.method("size")
    async def size(payload: bytes) -> int:
        return len(payload)

    return server


async def _settled(server: cxlrpc.Server, *clients: Any, timeout: float = 5.0) -> bool:
    """Poll until the server follows nothing and its heap holds nothing but the clients'
    spare extents (kept for their next followed request; FREE frames lag) and the reply
    extents parked for them."""
    def settled() -> bool:
        spares = {c._bodies.spare[0] for c in clients if c._bodies.spare is not None}
        heap = server._bodies.heap
        return not server._bodies.following and not heap._lent and set(heap._owners) - heap._parked_at == spares

    deadline = time.monotonic() + timeout
    while not settled() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return settled()


async def test_followed_requests_are_exact_around_the_threshold(name, copies, followed):
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        for size in SIZES:
            payload = os.urandom(size)
            assert await client.call("echo", payload, timeout=30) == payload
            assert await client.call("digest", payload, timeout=30) == hashlib.sha256(payload).hexdigest()
            assert await client.call("echo_view", payload, timeout=30) == payload
        numbers = list(range(100_000))  # ~290 KB of MessagePack
        assert await client.call("total", numbers, timeout=30) == sum(numbers)
        assert await _settled(server, client)
    assert sorted(s for m, s in followed if m == "echo") == FOLLOWED
    assert sorted(s for m, s in followed if m == "digest") == FOLLOWED
    # the first big body to a method that reads in place is followed; its reply says so
    assert [s for m, s in followed if m == "echo_view"] == FOLLOWED[:1]
    assert [m for m, s in followed if m == "total"] == ["total"]


async def test_a_blocking_client_follows_requests(name, followed):
    url = f"shm://{name}"
    async with _server(url) as server:
        def blocking() -> bool:
            with cxlrpc.connect_sync(url) as sync:
                ok = True
                for size in SIZES:
                    payload = os.urandom(size)
                    ok &= sync.call("echo", payload, timeout=30) == payload
                    ok &= sync.call("echo_view", payload, timeout=30) == payload
                return ok
        assert await asyncio.to_thread(blocking)
        assert await _settled(server)
    assert sorted(s for m, s in followed if m == "echo") == FOLLOWED
    assert [s for m, s in followed if m == "echo_view"] == FOLLOWED[:1]


@pytest.fixture
def allocs(monkeypatch) -> list[tuple[int, bool]]:
    """(size, spare asked) of each ALLOC the server read (Bodies.alloc spied on)."""
    seen: list[tuple[int, bool]] = []
    real = Bodies.alloc

    def spy(self, f):
        size, spare = GRANT.unpack(bytes(f.body))
        seen.append((size, bool(spare)))
        return real(self, f)

    monkeypatch.setattr(Bodies, "alloc", spy)
    return seen


async def test_a_spare_extent_saves_the_alloc_round_trip(name, allocs):
    """The first followed request ALLOCs a spare; the next ones of its size or smaller are
    written into it at once (no ALLOC); a bigger one gives it back for a new one; the
    client's departure frees the one it keeps."""
    url = f"shm://{name}"
    async with _server(url) as server:
        async with cxlrpc.connect(url) as client:
            for i in range(5):
                payload = os.urandom(MiB - i)  # the last body's bytes must not leak into this one
                assert await client.call("digest", payload, timeout=30) == hashlib.sha256(payload).hexdigest()
            assert allocs == [(FOLLOW_HEADER + MiB, True)]
            assert client._bodies.spare is not None and server._bodies.heap.is_spare(client._bodies.spare[0])
            bigger = os.urandom(2 * MiB)
            assert await client.call("echo", bigger, timeout=30) == bigger
            assert allocs[1:] == [(FOLLOW_HEADER + 2 * MiB, True)]
            assert await _settled(server, client)  # the small spare freed, the new one kept

            def blocking() -> bool:
                with cxlrpc.connect_sync(url) as sync:
                    ok = all(sync.call("size", bytes(MiB), timeout=30) == MiB for _ in range(3))
                    return ok and sync._bodies.spare is not None
            assert await asyncio.to_thread(blocking)
            assert allocs[2:] == [(FOLLOW_HEADER + MiB, True)]  # one for the blocking client's three
            assert server._bodies.heap.kept_bytes > 0
        assert await _settled(server)  # both clients left: their spares are freed
        assert server._bodies.heap.kept_bytes == 0


@pytest.fixture
def reference_large(monkeypatch) -> list[int]:
    """Body lengths of the requests the reference sent through the heap (Replies.call_large
    spied on): the native caller sends the rest."""
    seen: list[int] = []
    real = Replies.call_large

    def spy(self, call_id, large, *args):
        seen.append(len(large.body))
        return real(self, call_id, large, *args)

    monkeypatch.setattr(Replies, "call_large", spy)
    return seen


async def test_the_native_caller_writes_followed_bodies_into_the_spare(name, followed, reference_large):
    """Once a spare is kept, the native caller sends the frame and writes the body itself; a
    body the spare cannot hold goes the reference's way (which asks for a bigger spare)."""
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        assert client._conn.caller is not None
        bodies = [os.urandom(MiB - i * 4099) for i in range(6)]  # each shorter than the last
        for body in bodies:
            assert await client.call("echo", body, timeout=30) == body
        assert reference_large == [MiB]  # the first: it asks for the spare
        bigger = os.urandom(MiB + 1)
        assert await client.call("digest", bigger, timeout=30) == hashlib.sha256(bigger).hexdigest()
        assert await client.call("digest", bigger, timeout=30) == hashlib.sha256(bigger).hexdigest()
        assert reference_large == [MiB, MiB + 1]
        assert await _settled(server, client)
    assert [s for m, s in followed if m == "echo"] == [len(b) for b in bodies]
    assert [s for m, s in followed if m == "digest"] == [MiB + 1] * 2


async def test_tasks_sharing_a_client_share_its_spare_exactly(name):
    """Tasks taking turns on one client: each followed body reaches the server whole, natively
    or by the reference, however the spare passes between them (a task that gave way looks
    for it again)."""
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async def caller(k: int) -> bool:
            ok = True
            for i in range(5):
                body = os.urandom(FOLLOW_MIN + 4096 * (7 * k + i))
                ok &= await client.call("digest", body, timeout=30) == hashlib.sha256(body).hexdigest()
            return ok
        assert all(await asyncio.gather(*(caller(k) for k in range(4))))
        assert await _settled(server, client)


async def test_no_spare_is_kept_from_a_body_read_in_place(name):
    """A handler that reads its body in place may hold the extent past its reply (an async
    one gives it back after): the client gives it back rather than write its next body there."""
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        payload = os.urandom(MiB)
        assert await client.call("echo_view", payload, timeout=30) == payload
        assert client._bodies.spare is None
        assert await _settled(server, client)


async def test_a_call_given_up_keeps_no_spare_the_server_still_reads(name, monkeypatch):
    """A caller that gives up (here its CANCEL is lost) gives its extent back: the server may
    still be reading it, so its next call asks for another rather than write into that one."""
    monkeypatch.setattr(cxlrpc.server_bodies, "FOLLOW_STALL_S", 60.0)
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        with monkeypatch.context() as patched:
            patched.setattr(HeapAccess, "publish", lambda self, offset, body: None)
            patched.setattr(Connection, "send_cancel", lambda self, call_id: None)
            call = asyncio.ensure_future(client.call("size", bytes(MiB)))
            assert await _following(server)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        assert client._bodies.spare is None
        assert await client.call("size", bytes(MiB), timeout=10) == MiB
        assert len(server._bodies.following) == 1  # the first is still followed, in its own extent


async def test_spares_leave_room_for_a_body_of_max_message_size(name, allocs):
    """Spares take only the heap beyond max_message_size: past that budget a followed
    request's extent is freed by the server as before, and a body of max_message_size still
    fits beside the spares kept."""
    url = f"shm://{name}"
    size = 2 * MiB
    budget = MiB + MiB // 2  # one 1 MiB spare, not two
    async with _server(url, max_message_size=size, heap_size=size + budget) as server, \
            cxlrpc.connect(url) as a, cxlrpc.connect(url) as b:
        assert await a.call("size", bytes(MiB), timeout=30) == MiB
        assert await b.call("size", bytes(MiB), timeout=30) == MiB
        assert allocs == [(FOLLOW_HEADER + MiB, True)] * 2  # both asked
        assert a._bodies.spare is not None and b._bodies.spare is None  # the budget had room for one
        assert 0 < server._bodies.heap.kept_bytes <= budget
        assert await b.call("echo", b"x" * (size - FOLLOW_HEADER), timeout=30) == b"x" * (size - FOLLOW_HEADER)
        assert await _settled(server, a, b)


def test_a_spare_is_freed_after_the_server_reads_it_if_freed_meanwhile():
    """The server's heap: a spare FREEd while its body is read is freed when given back;
    one given back first stays its client's until its FREE or departure; spares stop at the
    budget and at SPARE_MAX."""
    buf = bytearray(16 * MiB)
    heap = ServerHeap(HeapAccess(memoryview(buf), AtomicMemory(buf), 0, len(buf)), spare_budget=3 * MiB)
    a = heap.alloc(1, 1, MiB, keep=True)
    assert heap.is_spare(a)
    heap.lend(a)
    assert heap.free(a, 1, 1)  # taken: it goes once read
    assert heap.used and not heap.is_spare(a)
    assert heap.give_back(a) and heap.used == 0
    b = heap.alloc(1, 1, MiB, keep=True)
    heap.lend(b)
    assert not heap.give_back(b) and heap.owned(b, MiB, 1, 1)  # read: the client's again
    c = heap.alloc(1, 1, MiB, keep=True)
    assert heap.is_spare(c) and heap.kept_bytes == 2 * MiB
    assert not heap.is_spare(heap.alloc(2, 1, MiB + 1, keep=True))  # past the budget
    assert not heap.is_spare(heap.alloc(2, 1, cxlrpc.heap.SPARE_MAX + 1, keep=True))
    heap.lend(c)
    assert heap.release_owner(1, 1) == 1  # b now; c once given back
    assert heap.kept_bytes == 0 and not heap.owned(b, 1, 1, 1)
    assert heap.give_back(c)
    assert heap.release_owner(2, 1) == 2 and heap.used == 0


def _half(self, offset, body):  # a client that freezes half way (and never writes the rest)
    at = self.start + offset
    publish_copy(self.mem, self.buf, at, at + FOLLOW_HEADER, memoryview(body)[:len(body) // 2])


async def test_a_client_that_stops_writing_is_unavailable_and_others_are_served(name, monkeypatch):
    monkeypatch.setattr(cxlrpc.server_bodies, "FOLLOW_STALL_S", 2.0)
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client, \
            cxlrpc.connect(url) as other:
        with monkeypatch.context() as patched:
            patched.setattr(HeapAccess, "publish", _half)
            stalled = asyncio.ensure_future(client.call("size", bytes(MiB), timeout=30))
            assert await _following(server)
        # the server's loop is not held by the stalled body: other calls are answered meanwhile
        for i in range(20):
            assert await other.call("echo", b"%d" % i, timeout=10) == b"%d" % i
        assert server._bodies.following and not stalled.done()
        with pytest.raises(cxlrpc.Unavailable, match="stopped writing"):
            await stalled
        assert await _settled(server, client, other)
        assert await client.call("size", bytes(MiB), timeout=10) == MiB


async def test_a_client_whose_copy_fails_is_refused_at_once(name, monkeypatch):
    def fails(mem, buf, progress_at, at, src, *seal):  # (a client passes its seal too)
        buf[at:at + 100] = bytes(src[:100])
        mem.store(progress_at, 100, memory.RELEASE)
        raise MemoryError("the copy failed half way")

    monkeypatch.setattr(cxlrpc.server_bodies, "FOLLOW_STALL_S", 60.0)  # not what ends it
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        with monkeypatch.context() as patched:
            patched.setattr(cxlrpc.heap, "publish_copy", fails)
            with pytest.raises(MemoryError):
                await client.call("size", bytes(MiB), timeout=30)
        assert await _settled(server, client, timeout=10)  # the aborted word, not the 60 s stall
        assert await client.call("size", bytes(MiB), timeout=10) == MiB


async def _following(server: cxlrpc.Server) -> bool:
    deadline = time.monotonic() + 10
    while not server._bodies.following and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    return bool(server._bodies.following)


@pytest.mark.parametrize("cancels", [True, False], ids=["cancel", "deadline"])
async def test_giving_up_on_a_followed_call_frees_its_extent(name, monkeypatch, cancels):
    """The caller's CANCEL ends the following (a call without a deadline); without it, the
    request's deadline does."""
    monkeypatch.setattr(cxlrpc.server_bodies, "FOLLOW_STALL_S", 60.0)  # not what ends it
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        with monkeypatch.context() as patched:
            patched.setattr(HeapAccess, "publish", lambda self, offset, body: None)
            if cancels:
                call = asyncio.ensure_future(client.call("size", bytes(MiB)))
                assert await _following(server)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            else:
                patched.setattr(Connection, "send_cancel", lambda self, call_id: None)
                with pytest.raises(cxlrpc.DeadlineExceeded):
                    await client.call("size", bytes(MiB), timeout=0.3)
            assert await _settled(server, client, timeout=10)
        assert await client.call("size", bytes(MiB), timeout=10) == MiB


async def test_a_client_that_leaves_mid_body_gets_its_extent_freed(name, monkeypatch):
    monkeypatch.setattr(cxlrpc.server_bodies, "FOLLOW_STALL_S", 60.0)  # not what ends it
    url = f"shm://{name}"
    async with _server(url) as server:
        client = await cxlrpc.connect(url)
        with monkeypatch.context() as patched:  # it never writes, and leaves without a CANCEL
            patched.setattr(HeapAccess, "publish", lambda self, offset, body: None)
            patched.setattr(Connection, "send_cancel", lambda self, call_id: None)
            try:
                call = asyncio.ensure_future(client.call("size", bytes(MiB)))
                assert await _following(server)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                assert server._bodies.following  # nobody told the server
            finally:
                await client.close()
        assert await _settled(server, timeout=10)


async def test_garbage_followed_requests_are_refused(name):
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        chan, loop = client._conn.chan, asyncio.get_running_loop()

        async def answer(call_id: int, extent: bytes) -> None:
            head = fr.HEADER.pack(fr.REQUEST, fr.RAW | fr.HEAP | fr.FOLLOW, 0, chan.slot, chan.gen,
                                  call_id, 5.0, 4)
            fut = loop.create_future()
            client._replies.pending[call_id] = (fut, None)
            try:
                assert chan.push((head, b"size", extent))
                chan.server_bell.ring()
                await asyncio.wait_for(fut, 10)
            finally:
                client._replies.pending.pop(call_id, None)

        # an extent the client was never granted
        with pytest.raises(cxlrpc.InvalidArgument, match="not in a heap extent"):
            await answer(4242, EXTENT.pack(0, MiB))
        # a granted one, whose progress word says more than its length
        alloc_id, alloc = client._bodies.alloc_request(FOLLOW_HEADER + MiB, 5.0)
        offset, spare = GRANT.unpack(await client._replies.granted(alloc_id, alloc, None))
        assert not spare  # (not asked for: the server frees it once done with it)
        client._bodies.heap.check(offset, FOLLOW_HEADER + MiB)
        client._bodies.heap.mem.store(client._bodies.heap.start + offset, MiB + 1, memory.RELEASE)
        with pytest.raises(cxlrpc.InvalidArgument, match="not written whole"):
            await answer(4243, EXTENT.pack(offset, MiB))
        assert await _settled(server, client)
        assert await client.call("size", bytes(MiB), timeout=10) == MiB


async def test_one_way_calls_keep_the_plain_way_and_no_coherence_follows_too(name, followed):
    sim = f"sim://{name}s"
    async with _server(sim, max_message_size=4 * MiB) as server, cxlrpc.connect(sim) as client:
        for size in (FOLLOW_MIN - 1, FOLLOW_MIN, 3 * MiB):
            payload = os.urandom(size)
            assert await client.call("echo", payload, timeout=30) == payload
        assert await _settled(server, client)
    assert followed == [("echo", FOLLOW_MIN), ("echo", 3 * MiB)]  # (flushed: cxlrpc._flush)
    followed.clear()
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        client.send_nowait("size", bytes(FOLLOW_MIN + 1))  # the ring takes it
        assert await client.call("size", b"x", timeout=10) == 1  # after the one-way call
        assert await _settled(server)
    assert followed == []


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "wait"])
def test_a_followed_body_is_taken_a_step_at_a_time(copies, copy):
    length = 6 * FOLLOW_CHUNK + 123
    src = os.urandom(length)
    buf = bytearray(FOLLOW_HEADER + length)
    mem = AtomicMemory(buf)
    body = FollowedBody(mem, memoryview(buf), 0, FOLLOW_HEADER, length, copy)
    assert not body.step(0.001, 0.01)  # nothing written yet: a short step, not a wait
    assert body.done == 0
    publish_copy(mem, memoryview(buf), 0, FOLLOW_HEADER, memoryview(src)[:2 * FOLLOW_CHUNK])
    assert not body.step(0.001, 0.01) and body.done == 2 * FOLLOW_CHUNK
    def rest() -> None:  # the writer goes on from there, a chunk at a time
        for at in range(2 * FOLLOW_CHUNK, length, FOLLOW_CHUNK):
            end = min(length, at + FOLLOW_CHUNK)
            buf[FOLLOW_HEADER + at:FOLLOW_HEADER + end] = src[at:end]
            mem.store(0, end, memory.RELEASE)
            time.sleep(0.002)

    writer = threading.Thread(target=rest)
    writer.start()
    deadline = time.monotonic() + 10
    while not body.step(0.001, 0.01) and time.monotonic() < deadline:
        pass
    writer.join(10)
    assert body.done == length
    assert body.take() == (src if copy else None)
    with pytest.raises(ValueError):
        body.take()


def test_a_garbage_progress_word_is_refused(copies):
    buf = bytearray(FOLLOW_HEADER + 1000)
    mem = AtomicMemory(buf)
    body = FollowedBody(mem, memoryview(buf), 0, FOLLOW_HEADER, 1000, True)
    mem.store(0, 1001, memory.RELEASE)
    with pytest.raises(ValueError, match="outside"):
        body.step(0.001, 0.01)
    with pytest.raises(ValueError):
        body.take()  # never complete


class _DispatchSpy:
    """Stands in for a server's native dispatcher where ``Bodies.follow_step`` looks it up:
    records whether each followed request was dispatched natively, and whether from a loop
    callback (no current task: its body was completed in a later step)."""

    def __init__(self, fast: Any) -> None:
        self.fast, self.taken = fast, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fast, name)

    def dispatch_body(self, *args: Any) -> bool:
        in_callback = asyncio.current_task() is None
        done = self.fast.dispatch_body(*args)
        self.taken.append((done, in_callback))
        return done


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
async def test_whole_followed_requests_are_dispatched_as_ring_records_are(name, monkeypatch, native):
    """A followed request whose body is whole goes to the native dispatcher (when the server
    has one) with the same outcome as the reference's: an async handler that suspends keeps
    its peer, a current task and its deadline, an error comes back as INTERNAL, a missing method as
    UNIMPLEMENTED. Bodies completed in a later step (a loop callback, no task current) too."""
    url = f"shm://{name}"
    server = _server(url)

    @server.method("inspect")
    async def inspect(payload: bytes) -> list:
        task, peer, call = asyncio.current_task(), cxlrpc.current_peer(), cxlrpc.context()
        await asyncio.sleep(0.005)  # suspends: a task carries it on
        return [hashlib.sha256(payload).hexdigest(), peer.slot,
                task is not None and isinstance(asyncio.current_task(), asyncio.Task),
                call.deadline is not None and 0 < call.time_remaining() <= 30]

    @server.method("boom")
    async def boom(payload: bytes) -> None:
        raise RuntimeError(f"boom after {len(payload)} bytes")

    held: list[tuple[HeapAccess, int, bytes]] = []

    def _first_half(self, offset, body):  # the rest is written once the server follows it
        held.append((self, offset, bytes(body)))
        _half(self, offset, body)

    async with server, cxlrpc.connect(url) as client:
        if server._calls._fast is None:
            pytest.skip("cxlrpc._dispatch was not built")
        spy = server._calls._fast = _DispatchSpy(server._calls._fast) if native else None
        assert await client.call("echo", b"x", timeout=10) == b"x"  # (the server's peer entry)
        payload = os.urandom(MiB + 13)
        want = [hashlib.sha256(payload).hexdigest(), client._conn.chan.slot, True, True]
        assert await client.call("inspect", payload, timeout=30) == want
        with pytest.raises(cxlrpc.Internal, match=f"boom after {MiB + 13} bytes"):
            await client.call("boom", payload, timeout=30)
        with pytest.raises(cxlrpc.Unimplemented):
            await client.call("missing", payload, timeout=30)
        with monkeypatch.context() as patched:
            patched.setattr(HeapAccess, "publish", _first_half)
            late = asyncio.ensure_future(client.call("inspect", payload, timeout=30))
            assert await _following(server)
        heap, offset, body = held[0]
        at = heap.start + offset
        heap.buf[at + FOLLOW_HEADER + len(body) // 2:at + FOLLOW_HEADER + len(body)] = body[len(body) // 2:]
        heap.mem.store(at, len(body), memory.RELEASE)
        assert await late == want
        assert await _settled(server, client)
    if native:  # (the missing method went back to the reference)
        assert spy.taken == [(True, False), (True, False), (False, False), (True, True)]
