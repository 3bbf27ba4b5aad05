"""Followed replies (cxlrpc.heap): a big response's frame goes first and the client copies its
body out of the heap as the server writes it. Exact at every size around the threshold and the
chunks, with the native copies and without; a stalled writer is an UNAVAILABLE error, not a
hang; a garbage progress word is refused; a request may claim the flag only with a heap extent
(tests/test_followed_requests.py); no heap room, or memory without coherence, sends the reply
the plain way."""
from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import threading
import time

import pytest

import cxlrpc
import cxlrpc.client_bodies
import cxlrpc.heap
from cxlrpc import frame as fr
from cxlrpc import memory
from cxlrpc.heap import FOLLOW_MIN, UNIT, HeapAccess, ServerHeap
from cxlrpc.memory import FOLLOW_CHUNK, AtomicMemory, follow_copy, publish_copy
from procs import echo_server, followed_server, made as _made

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20
SIZES = (FOLLOW_MIN - 1, FOLLOW_MIN, FOLLOW_MIN + 1, 5 * FOLLOW_CHUNK + 7, MiB + 13, 3 * MiB)


@pytest.fixture
def published(monkeypatch) -> list[int]:
    """The lengths of the reply bodies the server followed (ServerHeap.alloc_reply spied on: the
    native dispatcher and the reference both take a followed reply's extent there)."""
    lengths: list[int] = []
    real = ServerHeap.alloc_reply

    def spy(self, slot, gen, length):
        offset = real(self, slot, gen, length)
        if offset is not None:
            lengths.append(length - self.access.header)
        return offset

    monkeypatch.setattr(ServerHeap, "alloc_reply", spy)
    return lengths


def _server(url: str, **opts) -> cxlrpc.Server:
    server = cxlrpc.Server(url, **opts)

    @server.method("echo")
    async def echo(payload: bytes) -> bytes:
        return payload

    @server.method("make")
    def make(spec: list) -> bytes:
        size, seed = spec
        return _made(size, seed)

    @server.method("echo_view")
    def echo_view(payload: memoryview) -> memoryview:  # answered from its lent body
        return payload

    return server


async def _heap_empty(server: cxlrpc.Server, timeout: float = 5.0) -> bool:
    """Poll until the server's heap holds nothing (FREE frames are one-way: they lag)."""
    deadline = time.monotonic() + timeout
    while server._bodies.heap.used and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return server._bodies.heap.used == 0


async def test_followed_replies_are_exact_around_the_threshold(name, copies, published):
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        for i, size in enumerate(SIZES):
            payload = os.urandom(size)
            assert await client.call("echo", payload, timeout=30) == payload
            assert await client.call("echo_view", payload, timeout=30) == payload
            assert await client.call("make", [size, i], timeout=30) == _made(size, i)
        assert await _heap_empty(server)
    followed = [s for s in SIZES if s >= FOLLOW_MIN]
    assert sorted(published) == sorted(followed * 3)


async def test_a_blocking_client_reads_followed_replies(name, published):
    url = f"shm://{name}"
    async with _server(url) as server:
        def blocking() -> bool:
            with cxlrpc.connect_sync(url) as sync:
                return all(sync.call("make", [size, size], timeout=30) == _made(size, size)
                           for size in SIZES)
        assert await asyncio.to_thread(blocking)
        assert await _heap_empty(server)
    assert len(published) == len([s for s in SIZES if s >= FOLLOW_MIN])


def test_followed_bodies_cross_processes_intact(name):
    """The server in another process writes while this one reads: the copies overlap."""
    url = f"shm://{name}"
    with echo_server(url), cxlrpc.connect_sync(url) as client:
        for size in (FOLLOW_MIN, MiB + 5, 4 * MiB + 3):
            for _ in range(5):
                payload = os.urandom(size)
                assert client.call("echo", payload, timeout=30) == payload


def _word_and_data(length: int) -> tuple[bytearray, AtomicMemory]:
    buf = bytearray(64 + length)
    return buf, AtomicMemory(buf)


@pytest.mark.parametrize("length", [6 * FOLLOW_CHUNK + 123, memory.STREAM_WARM_MIN + 77])
def test_follow_copy_takes_what_a_concurrent_writer_publishes(copies, length):
    """Both copies at once (the native ones let go of the GIL), short and long."""
    src = os.urandom(length)
    buf, mem = _word_and_data(length)
    view = memoryview(buf)
    writer = threading.Thread(target=publish_copy, args=(mem, view, 0, 64, src))
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(follow_copy(mem, view, 0, 64, length, 5.0, 30.0)))
    reader.start()
    writer.start()
    writer.join(10)
    reader.join(10)
    view.release()
    assert got == [src] and mem.load(0, memory.ACQUIRE) == length


def test_follow_copy_gives_up_on_a_stalled_writer_and_refuses_garbage(copies):
    length = 4 * FOLLOW_CHUNK
    buf, mem = _word_and_data(length)
    view = memoryview(buf)
    mem.store(0, FOLLOW_CHUNK, memory.RELEASE)  # one chunk written, then the writer froze
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        follow_copy(mem, view, 0, 64, length, 0.2, 30.0)
    assert 0.2 <= time.monotonic() - start < 5
    mem.store(0, length + 8, memory.RELEASE)  # no writer counts past the body
    with pytest.raises(ValueError, match="progress"):
        follow_copy(mem, view, 0, 64, length, 5.0, 30.0)
    view.release()


def test_follow_copy_gives_up_on_a_writer_that_drips(copies):
    """A writer that keeps moving, a byte at a time, is given up at the limit, not followed
    for as long as it likes (the client's loop waits while it follows)."""
    length = 1 << 20
    buf, mem = _word_and_data(length)
    view = memoryview(buf)
    stop = threading.Event()

    def drip() -> None:
        done = 0
        while not stop.is_set() and done < length:
            done += 1
            mem.store(0, done, memory.RELEASE)
            time.sleep(0.005)

    writer = threading.Thread(target=drip)
    writer.start()
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            follow_copy(mem, view, 0, 64, length, 5.0, 0.3)
        assert time.monotonic() - start < 4.5  # the 5 s stall never came into it
    finally:
        stop.set()
        writer.join(10)
        view.release()


async def test_a_server_that_stops_writing_a_reply_is_unavailable_not_a_hang(name, monkeypatch):
    def half(self, offset, body):  # the server freezes half way (and never writes the rest)
        at = self.start + offset
        publish_copy(self.mem, self.buf, at, at + 64, memoryview(body)[:len(body) // 2])

    monkeypatch.setattr(cxlrpc.heap, "FOLLOW_STALL_S", 0.2)
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        with monkeypatch.context() as patched:
            patched.setattr(HeapAccess, "publish", half)
            with pytest.raises(cxlrpc.Unavailable, match="stopped writing"):
                await client.call("make", [MiB, 1], timeout=10)
        assert await client.call("make", [MiB, 2], timeout=10) == _made(MiB, 2)
        assert await _heap_empty(server)  # the stalled reply's extent was given back


async def test_a_server_whose_copy_fails_tells_the_client_at_once(name, monkeypatch):
    def fails(mem, buf, progress_at, at, src):
        buf[at:at + 100] = bytes(src[:100])
        mem.store(progress_at, 100, memory.RELEASE)
        raise MemoryError("the copy failed half way")

    monkeypatch.setattr(cxlrpc.heap, "FOLLOW_STALL_S", 60.0)  # the client must not wait for it
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        with monkeypatch.context() as patched:
            patched.setattr(cxlrpc.heap, "publish_copy", fails)
            start = time.monotonic()
            with pytest.raises(cxlrpc.Unavailable, match="stopped writing"):
                await client.call("make", [MiB, 1], timeout=30)
            assert time.monotonic() - start < 10
        assert await client.call("make", [MiB, 2], timeout=10) == _made(MiB, 2)
        assert await _heap_empty(server)


@pytest.fixture
def python_followed(monkeypatch) -> list[int]:
    """The call ids of followed replies the client's Python copied out (Bodies.heap_body)."""
    ids: list[int] = []
    real = cxlrpc.client_bodies.Bodies.heap_body

    def spy(self, f, wanted):
        ids.append(f.call_id)
        return real(self, f, wanted)

    monkeypatch.setattr(cxlrpc.client_bodies.Bodies, "heap_body", spy)
    return ids


def _hot_until_answered(client: cxlrpc.Client) -> None:
    """Poll for each reply in place until it comes (not the first 40 us only): every call's
    reply reaches the native caller, however slow the machine (the server is another process)."""
    client._conn.hot_s = client._conn.hot_spin_s = 30.0


async def _native_client(url: str) -> cxlrpc.Client:
    client = await cxlrpc.connect(url)
    assert client._conn.caller is not None
    for method, arg in (("make", [10, 0]), ("echo", b"x"), ("heap_used", None), ("publish", "whole")):
        await client.call(method, arg, timeout=30)  # (a method's first call names it: the reference)
    _hot_until_answered(client)
    return client


async def _server_heap_empty(client: cxlrpc.Client, timeout: float = 5.0) -> bool:
    """Poll until the server's heap holds nothing but spares (FREE frames are one-way: they lag)."""
    deadline = time.monotonic() + timeout
    while await client.call("heap_used", timeout=30) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return await client.call("heap_used", timeout=30) == 0


async def test_the_native_caller_follows_replies_itself(name, python_followed):
    """A followed reply to a native call is copied out in C, its extent given back (the
    server's heap empties): no Frame of it reaches the client's Python."""
    url = f"shm://{name}"
    with followed_server(url):
        client = await _native_client(url)
        try:
            body = os.urandom(MiB + 13)  # the reference follows it, and keeps a spare that holds it
            assert await client.call("echo", body, timeout=30) == body
            python_followed.clear()
            for i, size in enumerate((FOLLOW_MIN, MiB + 13, 3 * MiB)):
                assert await client.call("make", [size, i], timeout=30) == _made(size, i)
                if size <= MiB + 13:  # (its request followed too, natively, through the spare)
                    body = os.urandom(size)
                    assert await client.call("echo", body, timeout=30) == body
            assert python_followed == []
            assert await _server_heap_empty(client)
        finally:
            await client.close()


async def test_the_native_caller_gives_up_on_a_stalled_or_garbage_reply(name, monkeypatch, python_followed):
    """A server that stops writing a reply natively followed, or writes a garbage progress
    word, is Unavailable (the call cancelled, the extent given back), then calls go on."""
    monkeypatch.setattr(cxlrpc.heap, "FOLLOW_STALL_S", 0.2)  # (read when the client connects)
    url = f"shm://{name}"
    with followed_server(url):
        client = await _native_client(url)
        try:
            for how, why in (("half", "stopped writing.*0.2 s"), ("garbage", "progress word")):
                await client.call("publish", how, timeout=30)
                start = time.monotonic()
                with pytest.raises(cxlrpc.Unavailable, match=why):
                    await client.call("make", [MiB, 1], timeout=10)
                assert time.monotonic() - start < 5
                await client.call("publish", "whole", timeout=30)
                assert await client.call("make", [MiB, 2], timeout=10) == _made(MiB, 2)
                assert await _server_heap_empty(client)  # the broken reply's extent was given back
            assert python_followed == []
        finally:
            await client.close()


def test_a_freed_reply_extent_is_parked_for_its_connections_next_reply():
    """The server's heap: a followed reply's extent its client FREEs serves that connection's
    next followed reply (not another's, not a much smaller one), cannot be FREEd again or named
    as a request body meanwhile, and is freed for any alloc the heap has no other room for and
    when its connection leaves."""
    buf = bytearray(8 * MiB)
    heap = ServerHeap(HeapAccess(memoryview(buf), AtomicMemory(buf), 0, len(buf)))
    a = heap.alloc_reply(1, 1, MiB)
    assert heap.free(a, 1, 1) and heap.used == 0
    assert not heap.free(a, 1, 1) and not heap.owned(a, 1, 1, 1)  # parked: not the client's
    other = heap.alloc_reply(2, 1, MiB)
    assert other != a  # another connection's reply: a new extent
    assert heap.alloc_reply(1, 1, MiB - 5000) == a  # the connection's next: the parked one
    assert heap.owned(a, MiB - 5000, 1, 1) and not heap.owned(a, MiB, 1, 1)
    assert heap.free(a, 1, 1)
    small = heap.alloc_reply(1, 1, MiB // 2 - UNIT)  # under half the parked one: a new extent
    assert heap._alloc.size_of(small) == MiB // 2 - UNIT and heap.used == MiB + MiB // 2 - UNIT
    assert heap.free(small, 1, 1)
    assert heap.release_owner(2, 1) == 1 and heap.used == 0  # (small is parked)
    assert heap.alloc(3, 1, 8 * MiB - UNIT) == 0  # fits only once the parked extent is freed
    assert heap.release_owner(3, 1) == 1 and heap.used == 0
    b = heap.alloc_reply(4, 1, MiB)
    assert heap.free(b, 4, 1)
    assert heap.release_owner(4, 1) == 1  # the parked one, with its connection
    assert heap._alloc.used == 0  # nothing parked is left behind


async def test_a_request_claiming_the_follow_flag_is_dropped(name):
    """A request flagged FOLLOW without a heap extent (HEAP) is dropped, not served."""
    url = f"shm://{name}"
    async with _server(url) as server, cxlrpc.connect(url) as client:
        chan = client._conn.chan
        dropped = server.dropped_frames
        head = fr.HEADER.pack(fr.REQUEST, fr.RAW | fr.FOLLOW, 0, chan.slot, chan.gen, 4242, 5.0, 4)
        fut = asyncio.get_running_loop().create_future()
        client._replies.pending[4242] = (fut, None)
        try:
            assert chan.push((head, b"echo", b"served?"))
            chan.server_bell.ring()
            deadline = time.monotonic() + 5
            while server.dropped_frames == dropped and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert server.dropped_frames == dropped + 1
            assert await client.call("echo", b"k" * MiB, timeout=10) == b"k" * MiB
            assert not fut.done()  # the call after it was answered, this one never
        finally:
            client._replies.pending.pop(4242, None)


async def test_no_heap_room_sends_big_replies_the_plain_way_and_no_coherence_follows_them_too(name, published):
    url = f"shm://{name}"
    # a reply the size of the whole heap leaves no room for a progress word: into the ring
    async with _server(url, heap_size=512 << 10, max_message_size=512 << 10) as server, \
            cxlrpc.connect(url) as client:
        assert await client.call("make", [512 << 10, 3], timeout=10) == _made(512 << 10, 3)
        assert await _heap_empty(server)
    assert published == []
    sim = f"sim://{name}s"
    async with _server(sim, request_capacity=64 << 10, response_capacity=64 << 10,
                       max_message_size=2 * MiB) as server, cxlrpc.connect(sim) as client:
        assert server._replies.follow_min == FOLLOW_MIN  # (flushed: cxlrpc._flush.publish_flushed)
        for size in (FOLLOW_MIN, MiB + 1):
            assert await client.call("make", [size, 4], timeout=30) == _made(size, 4)
        assert await _heap_empty(server)
    assert published == [FOLLOW_MIN, MiB + 1]


async def test_replies_leave_the_heap_to_requests_that_wait_for_it(name, published):
    """While an ALLOC waits for heap room, a reply that fits its ring takes the ring, even
    with room left for it in the heap: the big request needs that room, the reply does not."""
    url = f"shm://{name}"
    async with _server(url, request_capacity=64 << 10, max_message_size=MiB, heap_size=MiB) as server, \
            cxlrpc.connect(url) as client:
        holder = await cxlrpc.connect(url)
        try:
            holder._conn.link.reader.cancel()  # its reply is never read: its extent stays taken
            chan = holder._conn.chan
            assert chan.push(holder._codec.request(7, "make", [300 << 10, 9], 0.0))
            chan.server_bell.ring()
            deadline = time.monotonic() + 10
            while not server._bodies.heap.used and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert published == [300 << 10]
            big = asyncio.ensure_future(client.call("echo", b"w" * 800_000, timeout=30))
            while not server._bodies.heap_waiting and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert server._bodies.heap_waiting, "the 800 KB request should wait for the heap"
            assert await client.call("make", [256 << 10, 5], timeout=10) == _made(256 << 10, 5)
            assert published == [300 << 10]  # the ring carried it
        finally:
            await holder.close()  # its departure frees the unread reply's extent
        assert await big == b"w" * 800_000
        assert await _heap_empty(server)
