"""Server streams: an async generator handler, read with ``async for`` through
``client.stream``; flow-controlled by credit, cancellable from the caller, ended by errors and
deadlines, big items through the heap; on coherent memory and the simulator."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

import cxlrpc
from cxlrpc.server import STREAM_WINDOW
from procs import until

pytestmark = pytest.mark.timeout(60)


class Tick(msgspec.Struct):
    n: int
    square: int


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


def _server(url: str) -> cxlrpc.Server:
    opts = ({"request_capacity": 64 << 10, "response_capacity": 64 << 10, "max_message_size": 1 << 20}
            if url.startswith("sim://") else {})
    server = cxlrpc.Server(url, **opts)
    server.produced = []
    server.closed = asyncio.Event()

    @server.method("ticks")
    async def ticks(n: int):
        try:
            for i in range(n):
                server.produced.append(i)
                yield Tick(i, i * i)
        finally:
            server.closed.set()

    @server.method("blobs")
    async def blobs(spec: list):
        count, size = spec
        for i in range(count):
            yield bytes([i]) * size

    @server.method("fails")
    async def fails(after: int):
        for i in range(after):
            yield i
        raise cxlrpc.FailedPrecondition(f"stopped after {after}")

    @server.method("forever")
    async def forever():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield b"."
        finally:
            server.closed.set()

    return server


async def test_items_arrive_in_order_decoded_and_the_stream_ends(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        got = [t async for t in client.stream("ticks", 500, response_type=Tick, timeout=30)]
        assert got == [Tick(i, i * i) for i in range(500)]
        assert await client.call("cxlrpc.health", timeout=5)  # the connection goes on
        assert await until(lambda: not server._tasks and not server._streams.credits, 5)


async def test_a_slow_reader_slows_the_writer(url):
    """The handler runs at most a window of items ahead of what the caller took."""
    async with _server(url) as server, cxlrpc.connect(url) as client:
        taken = 0
        async for _ in client.stream("ticks", 10 * STREAM_WINDOW, timeout=30):
            taken += 1
            await asyncio.sleep(0.002)
            assert len(server.produced) <= taken + STREAM_WINDOW + 1
        assert taken == 10 * STREAM_WINDOW


async def test_leaving_the_loop_cancels_the_handler(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async for item in client.stream("forever", timeout=30):
            assert item == b"."
            break
        assert await until(server.closed.is_set, 5)  # the generator's finally ran
        assert await until(lambda: not server._tasks and not server._streams.credits, 5)


async def test_an_error_ends_the_stream_after_its_items(url):
    async with _server(url), cxlrpc.connect(url) as client:
        got = []
        with pytest.raises(cxlrpc.FailedPrecondition, match="stopped after 3"):
            async for item in client.stream("fails", 3, timeout=10):
                got.append(item)
        assert got == [0, 1, 2]


async def test_a_deadline_bounds_the_whole_stream(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        with pytest.raises(cxlrpc.DeadlineExceeded):
            async for _ in client.stream("forever", timeout=0.2):
                pass
        assert await until(server.closed.is_set, 5)


async def test_items_bigger_than_a_ring_go_through_the_heap(url):
    size = (900 << 10) if url.startswith("sim://") else (3 << 20)
    async with _server(url) as server, cxlrpc.connect(url) as client:
        got = [item async for item in client.stream("blobs", [4, size], timeout=30)]
        assert got == [bytes([i]) * size for i in range(4)]
        assert await until(lambda: server._bodies.heap.used == 0, 5)


async def test_closing_the_client_mid_stream_ends_the_handler(url):
    async with _server(url) as server:
        client = await cxlrpc.connect(url)
        stream = client.stream("forever", timeout=30)
        assert await stream.__anext__() == b"."
        await client.close()
        assert await until(server.closed.is_set, 5)  # departed: its handler was cancelled
        await stream.aclose()


def test_stream_handlers_cannot_be_blocking():
    server = cxlrpc.Server("shm://never-started-stream")

    async def gen(x):
        yield x

    with pytest.raises(ValueError, match="blocking=True"):
        server.add_method("g", gen, blocking=True)


async def test_a_stream_after_a_call_is_read(url):
    """After a call the reader rests (the caller polled its reply itself): a stream wakes it."""
    async with _server(url), cxlrpc.connect(url) as client:
        assert await client.call("cxlrpc.health", timeout=5)
        got = [t async for t in client.stream("ticks", 5, response_type=Tick, timeout=10)]
        assert [t.n for t in got] == [0, 1, 2, 3, 4]
