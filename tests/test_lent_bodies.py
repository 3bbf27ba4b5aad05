"""Request bodies lent to handlers: a plain handler taking ``memoryview`` reads its request
where it lies (the ring record, or its heap extent) with no copy, and the view ends when the
handler returns; other handler shapes that take a memoryview get a view of a private copy.
On coherent memory (shm://) and on the simulator of memory without coherence (sim://)."""
from __future__ import annotations

import asyncio
import hashlib
import mmap

import numpy as np
import pytest

import cxlrpc
from cxlrpc import frame as fr
from procs import sized_for, until

MEMORIES = ("shm", "sim")
pytestmark = pytest.mark.timeout(60)


def payload(size: int) -> bytes:
    return np.random.default_rng(size).bytes(size)


class Seen:
    """What the handlers were given, for the test to look at after the call."""

    def __init__(self) -> None:
        self.views: list[memoryview] = []
        self.owners: list[type] = []
        self.readonly: list[bool] = []
        self.sizes: list[int] = []

    def saw(self, data: memoryview) -> None:
        self.views.append(data)
        self.owners.append(type(data.obj))
        self.readonly.append(data.readonly)
        self.sizes.append(len(data))


def make_server(url: str, seen: Seen, **opts) -> cxlrpc.Server:
    server = cxlrpc.Server(url, **sized_for(url, opts))

    @server.method("echo")
    def echo(data: memoryview) -> memoryview:
        seen.saw(data)
        return data  # a view of the request: copied into the reply before the record is reused

    @server.method("digest")
    def digest(data: memoryview) -> bytes:
        seen.saw(data)
        return hashlib.sha256(data).digest()

    @server.method("tail")
    def tail(data: memoryview) -> memoryview:
        return data[len(data) // 2:]  # a view derived from the lent one

    @server.method("boom")
    def boom(data: memoryview) -> None:
        seen.saw(data)
        raise ValueError("no")

    @server.method("aecho")
    async def aecho(data: memoryview) -> bytes:
        seen.saw(data)
        await asyncio.sleep(0.01)  # suspends: the record is long reused when it resumes
        return bytes(data)

    @server.method("wraps")
    def wraps(data: memoryview):
        return aecho(data)  # a plain function returning a coroutine that would read the view

    return server


def heap_limit(url: str, server: cxlrpc.Server) -> int:
    """A size that travels through the heap (past the request ring's frame limit)."""
    return server.max_message_size // 2 if url.startswith("sim://") else 3 << 20


def held(server: cxlrpc.Server, client: cxlrpc.Client) -> int:
    """Heap bytes the server holds but the client's spare extent (its own, for its next request)."""
    heap, spare = server._bodies.heap, client._bodies.spare
    return heap.used - (heap._alloc.size_of(spare[0]) if spare is not None else 0)


async def test_plain_handler_reads_the_body_in_place(url: str) -> None:
    seen = Seen()
    server = make_server(url, seen)
    async with server, cxlrpc.connect(url) as client:
        sizes = (1, 64, 4096, 200_000, heap_limit(url, server))
        for size in sizes:
            body = payload(size)
            assert await client.call("echo", body) == body, size
            assert await client.call("digest", body) == hashlib.sha256(body).digest()
            assert await client.call("tail", body) == body[size // 2:]
        # every view was of the region's own mapping (ring or heap), read-only, no copy
        assert seen.owners == [mmap.mmap] * (2 * len(sizes)), seen.owners
        assert all(seen.readonly)
        # the lent extents were freed after each call (reply extents once the client's FREE is in)
        assert await until(lambda: server._bodies.heap.used == 0, 5), server._bodies.heap.used


async def test_a_kept_view_is_ended_when_the_handler_returns(url: str) -> None:
    seen = Seen()
    async with make_server(url, seen), cxlrpc.connect(url) as client:
        assert await client.call("echo", b"first") == b"first"
        assert await client.call("echo", b"second") == b"second"
        first = seen.views[0]
        with pytest.raises(ValueError, match="released"):
            bytes(first)  # not the bytes of a later request


async def test_a_failing_handler_ends_its_view_and_frees_the_extent(url: str) -> None:
    seen = Seen()
    server = make_server(url, seen)
    async with server, cxlrpc.connect(url) as client:
        for size in (16, heap_limit(url, server)):
            with pytest.raises(cxlrpc.Internal, match="ValueError: no"):
                await client.call("boom", payload(size))
            with pytest.raises(ValueError, match="released"):
                bytes(seen.views[-1])
        assert await until(lambda: server._bodies.heap.used == 0, 5), server._bodies.heap.used
        assert await client.call("echo", b"still serving") == b"still serving"


async def test_one_way_calls_to_a_lending_method_are_served_in_place(url: str) -> None:
    seen = Seen()
    async with make_server(url, seen), cxlrpc.connect(url) as client:
        body = payload(60_000)
        for _ in range(3):
            client.send_nowait("digest", body)
        assert await client.call("digest", b"x") == hashlib.sha256(b"x").digest()  # after them
        assert seen.owners == [mmap.mmap] * 4
        for view in seen.views:
            with pytest.raises(ValueError, match="released"):
                bytes(view)


async def test_async_handler_copies_a_ring_body_and_keeps_a_heap_one(url: str) -> None:
    seen = Seen()
    server = make_server(url, seen)
    async with server, cxlrpc.connect(url) as client:
        bodies = [payload(n) for n in (64, 100_000, heap_limit(url, server))]
        # several in flight: each resumes after others' records were written over its own
        got = await asyncio.gather(*(client.call("aecho", b) for b in bodies * 2))
        assert got == bodies * 2
        assert all(seen.readonly)
        owners = dict(zip(seen.sizes, seen.owners))
        assert owners == {64: bytes, 100_000: bytes, len(bodies[2]): mmap.mmap}, owners
        assert await until(lambda: held(server, client) == 0, 5), held(server, client)
        for view, size in zip(seen.views, seen.sizes):  # ended with their handlers
            if size == len(bodies[2]):
                with pytest.raises(ValueError, match="released"):
                    bytes(view)


async def test_a_lent_extent_outlives_its_departed_caller_until_the_handler_ends(url: str) -> None:
    """The heap keeps an extent a handler still reads after its caller left: another client's
    big request waits for room instead of being written over the bytes being read."""
    limit = 4 << 20 if url.startswith("shm") else 1 << 20
    server = cxlrpc.Server(url, **sized_for(url, {"max_message_size": limit, "heap_size": limit}))
    entered, go, digests = asyncio.Event(), asyncio.Event(), []

    @server.method("hold")
    async def hold(data: memoryview) -> None:
        entered.set()
        try:
            await go.wait()
        except asyncio.CancelledError:
            await go.wait()  # reads on after its caller left (and its call was cancelled)
        digests.append(hashlib.sha256(data).digest())

    @server.method("digest")
    def digest(data: memoryview) -> bytes:
        return hashlib.sha256(data).digest()

    size = int(limit * 0.6)  # past a ring's frame limit; two do not fit in the heap
    first, second = payload(size), payload(size + 1)
    async with server:
        a = await cxlrpc.connect(url)
        call = asyncio.ensure_future(a.call("hold", first, timeout=30))
        await asyncio.wait_for(entered.wait(), 10)
        await a.close()  # departs; its call is cancelled on both sides
        with pytest.raises(cxlrpc.Unavailable, match="client closed"):
            await call
        assert await until(lambda: server._chan.slot_generation(0) < 0, 5)
        assert server._bodies.heap.used >= size  # still lent
        async with cxlrpc.connect(url) as b:
            other = asyncio.ensure_future(b.call("digest", second, timeout=30))
            await asyncio.sleep(0.2)  # the condition under test is that nothing happens
            assert not other.done()  # waiting for room, not writing over the lent extent
            go.set()
            assert await other == hashlib.sha256(second).digest()
        assert digests == [hashlib.sha256(first).digest()]
        assert await until(lambda: server._bodies.heap.used == 0, 5), server._bodies.heap.used


async def test_plain_handler_returning_a_coroutine_is_refused_clearly(url: str) -> None:
    async with make_server(url, Seen()), cxlrpc.connect(url) as client:
        with pytest.raises(cxlrpc.Internal, match="returned a coroutine: make it an `async def`"):
            await client.call("wraps", b"abc")


async def test_with_interceptors_the_body_is_a_view_of_a_copy(url: str) -> None:
    calls = []

    async def count(ctx, proceed):
        calls.append(ctx.method)
        return await proceed()

    seen = Seen()
    async with make_server(url, seen, interceptors=[count]), cxlrpc.connect(url) as client:
        assert await client.call("echo", b"through the chain") == b"through the chain"
    assert calls == ["echo"] and seen.owners == [bytes]


def test_decode_lends_only_requests_of_the_methods_named() -> None:
    body = b"the body"
    for kind, lent in ((fr.REQUEST, True), (fr.RESPONSE, False), (fr.ITEM, False)):
        record = memoryview(bytearray(fr.header(kind, fr.RAW, 0, 1, 2, 3, 0.0, b"m") + b"m" + body))
        for decode in {fr.decode, fr._decode_py}:
            assert type(decode(record).body) is bytes
            assert type(decode(record, {"other"}).body) is bytes
            f = decode(record, frozenset({"m"}))
            assert type(f.body) is (memoryview if lent else bytes), (decode, kind)
            assert bytes(f.body) == body
            if lent:
                assert f.body.readonly and f.body.obj is record.obj
    if fr.decode is not fr._decode_py:  # the native decode checks what it is given
        with pytest.raises(TypeError, match="set or frozenset"):
            fr.decode(record, ["m"])
