"""Client-streaming and bidirectional calls: a handler reading an ``AsyncIterator[T]`` of
requests, fed through ``client.open_stream``; credit both ways, cancellation from either side,
errors, deadlines, big items through the heap, interceptors and typed stubs; on coherent
memory and the simulator."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

import msgspec
import pytest

import cxlrpc
from cxlrpc.streams import STREAM_WINDOW
from procs import until

pytestmark = pytest.mark.timeout(60)


class Point(msgspec.Struct):
    x: int
    y: int


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


def _small(url: str) -> dict:
    return ({"request_capacity": 64 << 10, "response_capacity": 64 << 10, "max_message_size": 1 << 20}
            if url.startswith("sim://") else {"request_capacity": 1 << 20, "response_capacity": 1 << 20})


def _server(url: str, **opts: Any) -> cxlrpc.Server:
    server = cxlrpc.Server(url, **_small(url), **opts)
    server.taken = 0
    server.ended = asyncio.Event()

    @server.method("total")
    async def total(xs: AsyncIterator[int]) -> int:
        return sum([x async for x in xs])

    @server.method("centroid")
    async def centroid(points: AsyncIterator[Point]) -> Point:
        got = [p async for p in points]
        return Point(sum(p.x for p in got) // len(got), sum(p.y for p in got) // len(got))

    @server.method("slow_total")
    async def slow_total(xs: AsyncIterator[int]) -> int:
        n = 0
        async for x in xs:
            server.taken += 1
            n += x
            await asyncio.sleep(0.001)
        return n

    @server.method("first")
    async def first(xs: AsyncIterator[bytes]) -> bytes:
        async for x in xs:
            return x  # early: the rest of the requests are not wanted
        return b""

    @server.method("sizes")
    async def sizes(blobs: AsyncIterator[bytes]) -> list:
        return [(len(b), b[:1]) async for b in blobs]

    @server.method("stuck")
    async def stuck(xs: AsyncIterator[int]) -> int:
        try:
            await asyncio.sleep(3600)
            return 0
        finally:
            server.ended.set()

    @server.method("hoard")
    async def hoard(blobs: AsyncIterator[bytes]) -> int:
        await asyncio.sleep(3600)  # takes none of its items
        return 0

    @server.method("refuse")
    async def refuse(xs: AsyncIterator[int]) -> int:
        async for x in xs:
            if x < 0:
                raise cxlrpc.OutOfRange(f"{x} is negative")
        return 0

    @server.method("squares")
    async def squares(xs: AsyncIterator[int]):
        try:
            async for x in xs:
                yield x * x
        finally:
            server.ended.set()

    @server.method("unary")
    async def unary(x: int) -> int:
        return x

    return server


def _quiet(server: cxlrpc.Server) -> bool:
    return not server._tasks and not server._streams.inbound and not server._streams.credits


async def test_a_client_stream_is_summed_and_answered_once(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("total", timeout=30, response_type=int) as call:
            for i in range(500):
                await call.send(i)
            assert await call.response() == sum(range(500))
        async with client.open_stream("centroid", timeout=30, response_type=Point) as call:
            for p in (Point(0, 0), Point(2, 4), Point(4, 8)):
                await call.send(p)
            await call.done_writing()
            assert await call.response() == Point(2, 4)
        assert await until(lambda: _quiet(server), 5) and not client._streams


async def test_a_slow_handler_slows_the_sender(url):
    """The caller runs at most a window of items ahead of what the handler took."""
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("slow_total", timeout=30, response_type=int) as call:
            for i in range(6 * STREAM_WINDOW):
                await call.send(1)
                assert i + 1 - server.taken <= STREAM_WINDOW
            assert await call.response() == 6 * STREAM_WINDOW


async def test_bidirectional_replies_interleave_with_requests(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("squares", timeout=30, response_type=int) as call:
            replies = call.__aiter__()
            for i in range(3 * STREAM_WINDOW):  # one in, one out: both windows turn over
                await call.send(i)
                assert await replies.__anext__() == i * i
            await call.done_writing()
            assert [r async for r in call] == []
        assert await until(server.ended.is_set, 5)
        assert await until(lambda: _quiet(server), 5)


async def test_a_bidirectional_call_streams_ahead_both_ways(url):
    async with _server(url), cxlrpc.connect(url) as client:
        async with client.open_stream("squares", timeout=30) as call:
            async def write() -> None:
                for i in range(1000):
                    await call.send(i)
                await call.done_writing()
            writer = asyncio.create_task(write())
            assert [r async for r in call] == [i * i for i in range(1000)]
            await writer


async def test_items_bigger_than_the_ring_go_through_the_heap(url):
    size = (200 << 10) if url.startswith("sim://") else (3 << 20)
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("sizes", timeout=30, response_type=list[tuple[int, bytes]]) as call:
            for i in range(3):
                await call.send(bytes([i]) * size)
            await call.send(b"small")
            assert await call.response() == [(size, b"\0"), (size, b"\1"), (size, b"\2"), (5, b"s")]
        assert await until(lambda: server._bodies.heap.used == 0, 5)


async def test_a_handler_that_returns_early_ends_the_call(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("first", timeout=30) as call:
            await call.send(b"a")
            assert await until(lambda: call._final is not None, 5)
            with pytest.raises(asyncio.InvalidStateError, match="already ended"):
                await call.send(b"b")
            assert await call.response() == b"a"
        assert await until(lambda: _quiet(server), 5)
        assert await client.call("unary", 7, timeout=5) == 7  # later items were dropped quietly


async def test_a_handler_error_reaches_the_sender_and_the_reader(url):
    async with _server(url), cxlrpc.connect(url) as client:
        async with client.open_stream("refuse", timeout=30) as call:
            await call.send(-1)
            with pytest.raises(cxlrpc.OutOfRange, match="-1 is negative"):
                await call.response()
        async with client.open_stream("refuse", timeout=30) as call:
            await call.send(-2)
            with pytest.raises(cxlrpc.OutOfRange):
                for _ in range(10 * STREAM_WINDOW):  # credit runs out: the error wakes the send
                    await call.send(1)


async def test_bad_request_items_fail_the_call(url):
    async with _server(url), cxlrpc.connect(url) as client:
        async with client.open_stream("centroid", timeout=30, response_type=Point) as call:
            await call.send(Point(1, 1))
            await call.send({"x": "not an int"})
            with pytest.raises(cxlrpc.InvalidArgument, match="bad request item for 'centroid'"):
                await call.response()


async def test_items_beyond_the_credit_fail_the_call(url):
    """A caller that ignores its credit (garbage, or a broken peer) is refused, not queued."""
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("stuck", timeout=30) as call:
            call._credit = 10 * STREAM_WINDOW  # pretend the server granted more
            with pytest.raises(cxlrpc.InvalidArgument, match="beyond its credit"):
                for _ in range(10 * STREAM_WINDOW):
                    await call.send(1)
                    await asyncio.sleep(0)
                # the handler never reads: the refusal comes when it ends, by cancellation
        assert await until(server.ended.is_set, 5)


async def test_leaving_the_block_cancels_the_handler(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("stuck", timeout=30) as call:
            await call.send(1)
        assert await until(server.ended.is_set, 5)
        assert await until(lambda: _quiet(server), 5) and not client._streams


async def test_leaving_a_bidirectional_loop_cancels_the_handler(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("squares", timeout=30) as call:
            await call.send(3)
            async for reply in call:
                assert reply == 9
                break
        assert await until(server.ended.is_set, 5)
        assert await until(lambda: _quiet(server), 5)


async def test_a_caller_cancelled_while_the_call_opens_cancels_it(url):
    """``async with`` runs no exit when its enter is cancelled: the call cancels itself."""
    async with _server(url) as server, cxlrpc.connect(url) as client:
        call = client.open_stream("stuck", timeout=30)
        entering = asyncio.create_task(call.__aenter__())
        await asyncio.sleep(0)  # it waits for the opening now
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        assert await until(server.ended.is_set, 5)
        assert await until(lambda: _quiet(server), 5) and not client._streams
        with pytest.raises(cxlrpc.Cancelled):
            await call.response()


async def test_a_deadline_bounds_the_whole_call(url):
    async with _server(url) as server, cxlrpc.connect(url) as client:
        async with client.open_stream("stuck", timeout=0.3) as call:
            with pytest.raises(cxlrpc.DeadlineExceeded):
                for _ in range(10 * STREAM_WINDOW):  # blocks once the credit is spent
                    await call.send(1)
        assert await until(server.ended.is_set, 5)
        server.ended.clear()
        async with client.open_stream("stuck", timeout=0.3) as call:
            with pytest.raises(cxlrpc.DeadlineExceeded):
                await call.response()
        assert await until(server.ended.is_set, 5)


async def test_closing_the_client_mid_call_cancels_the_handler(url):
    async with _server(url) as server:
        client = await cxlrpc.connect(url)
        call = client.open_stream("stuck", timeout=30)
        await call.send(1)
        await client.close()
        assert await until(server.ended.is_set, 5)  # departed: its handler was cancelled
        with pytest.raises(cxlrpc.Unavailable):
            await call.response()


async def test_calls_of_the_wrong_shape_are_refused(url):
    async with _server(url), cxlrpc.connect(url) as client:
        with pytest.raises(cxlrpc.InvalidArgument, match="takes a stream of requests"):
            await client.call("total", 3, timeout=5)
        with pytest.raises(cxlrpc.InvalidArgument, match="not a stream: call it with call()"):
            async with client.open_stream("unary", timeout=5) as call:
                await call.response()
        with pytest.raises(cxlrpc.InvalidArgument, match="takes a stream of requests"):
            async for _ in client.stream("squares", 3, timeout=5):
                pass
        with pytest.raises(cxlrpc.Unimplemented):
            async with client.open_stream("nope", timeout=5) as call:
                await call.response()
        async with client.open_stream("total", timeout=5) as call:
            await call.done_writing()
            with pytest.raises(asyncio.InvalidStateError, match="after done_writing"):
                await call.send(1)
            assert await call.response() == 0
        async with client.open_stream("squares", timeout=5) as call:
            await call.send(2)
            with pytest.raises(asyncio.InvalidStateError, match="streams its replies"):
                await call.response()


def test_handlers_that_cannot_read_a_request_stream_are_refused():
    server = cxlrpc.Server("shm://never-started-request-stream")

    def plain(xs: AsyncIterator[int]) -> int:
        return 0

    with pytest.raises(TypeError, match="must be an `async def`"):
        server.add_method("plain", plain)


# ---------------------------------------------------------------- interceptors

async def test_interceptors_see_streaming_calls_on_both_sides(url):
    seen: list[tuple] = []

    async def audit(call: cxlrpc.HandlerContext, next):
        if call.metadata.get("tenant") != "t1":
            raise cxlrpc.PermissionDenied("wrong tenant")
        result = await next()
        seen.append((call.method, type(result).__name__))
        return result

    async def tenant(method, arg, metadata, next):
        metadata["tenant"] = "t1"
        return await next(method, arg, metadata)

    server = _server(url, interceptors=[audit])

    @server.method("ticks")
    async def ticks(n: int):
        for i in range(n):
            yield i

    async with server, cxlrpc.connect(url, interceptors=[tenant]) as client:
        async with client.open_stream("total", timeout=10, response_type=int) as call:
            for i in range(4):
                await call.send(i)
            assert await call.response() == 6
        async with client.open_stream("squares", timeout=10) as call:
            await call.send(5)
            await call.done_writing()
            assert [r async for r in call] == [25]
        assert [t async for t in client.stream("ticks", 3, timeout=10)] == [0, 1, 2]
        assert seen[0] == ("total", "int")
        assert [m for m, _ in seen[1:]] == ["squares", "ticks"]  # next() gave their streams
        async with cxlrpc.connect(url) as stranger:  # no tenant: refused before the handler
            with pytest.raises(cxlrpc.PermissionDenied):
                async for _ in stranger.stream("ticks", 3, timeout=10):
                    pass
            with pytest.raises(cxlrpc.PermissionDenied):
                async with stranger.open_stream("total", timeout=10) as call:
                    await call.send(1)
                    await call.response()


async def test_an_interceptor_may_wrap_the_reply_stream(url):
    async def doubled(call: cxlrpc.HandlerContext, next):
        replies = await next()

        async def wrapped():
            async for r in replies:
                yield 2 * r
        return wrapped()

    async with _server(url, interceptors=[doubled]), cxlrpc.connect(url) as client:
        async with client.open_stream("squares", timeout=10) as call:
            await call.send(3)
            await call.done_writing()
            assert [r async for r in call] == [18]


# ---------------------------------------------------------------- typed stubs

class Stats(cxlrpc.Service, Protocol):
    async def total(self, xs: AsyncIterator[int]) -> int: ...
    def squares(self, xs: AsyncIterator[int]) -> AsyncIterator[int]: ...
    def countdown(self, n: int) -> AsyncIterator[int]: ...


class StatsImpl:
    async def total(self, xs):  # the contract says it reads a stream (no annotation here)
        return sum([x async for x in xs])

    async def squares(self, xs):
        async for x in xs:
            yield x * x

    async def countdown(self, n: int):
        for i in range(n, 0, -1):
            yield i


async def test_typed_stubs_of_every_stream_shape(url):
    server = cxlrpc.Server(url, **_small(url))
    server.add_service(Stats, StatsImpl())

    async def numbers():
        for i in range(5):
            yield i

    async with server, cxlrpc.connect(url) as client:
        stats = client.stub(Stats, timeout=10)
        assert await stats.total(numbers()) == 10
        assert await stats.total(range(100)) == 4950  # type: ignore[arg-type]
        assert [x async for x in stats.squares(numbers())] == [0, 1, 4, 9, 16]
        assert [x async for x in stats.countdown(3)] == [3, 2, 1]


async def test_a_failing_request_iterator_cancels_a_bidirectional_stub_call(url):
    server = cxlrpc.Server(url, **_small(url))
    server.add_service(Stats, StatsImpl())

    async def broken():
        yield 1
        raise RuntimeError("the source broke")

    async with server, cxlrpc.connect(url) as client:
        got = []
        with pytest.raises(RuntimeError, match="the source broke"):
            async for x in client.stub(Stats, timeout=10).squares(broken()):
                got.append(x)
        assert got in ([], [1])
        assert await until(lambda: not server._tasks and not server._streams.inbound, 5)


def test_contracts_and_implementations_must_agree_on_streams():
    class AsyncStream(cxlrpc.Service, Protocol):
        async def ticks(self, n: int) -> AsyncIterator[int]: ...

    class NoYield:
        async def countdown(self, n):
            return n

        async def total(self, xs):
            return 0

        async def squares(self, xs):
            yield 0

    from cxlrpc.service import rpcs
    with pytest.raises(TypeError, match="AsyncIterator"):
        rpcs(AsyncStream)
    server = cxlrpc.Server("shm://never-started-stats")
    with pytest.raises(TypeError, match="must be an async generator"):
        server.add_service(Stats, NoYield())


# ---------------------------------------------------------------- the example

def test_streaming_service_example_runs(name):
    """examples/streaming_service.py: every stream shape through a typed stub and
    interceptors; the tokenless caller is refused; it exits 0."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, str(root / "examples" / "streaming_service.py"),
                           f"shm://{name}"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert "record: Summary(count=150" in done.stdout
    assert "server: Telemetry.normalize streamed 4 items" in done.stdout
    assert "stranger: UNAUTHENTICATED" in done.stdout


async def test_request_stream_bytes_of_one_connection_are_bounded(url):
    """Items a handler has not taken are bounded per connection across all its streams
    (max_stream_bytes; each stream alone holds at most its credit of items): the item past it
    fails its stream RESOURCE_EXHAUSTED, another connection's streams are untouched, and the
    bytes of ended streams no longer count."""
    async with _server(url, max_stream_bytes=256 << 10) as server, \
            cxlrpc.connect(url) as client, cxlrpc.connect(url) as other:
        item = b"x" * (40 << 10)
        async with client.open_stream("hoard", timeout=30) as first:
            for _ in range(4):  # 160 KiB held by a handler that takes nothing
                await first.send(item)
            async with other.open_stream("sizes", timeout=30, response_type=list) as bystander:
                async with client.open_stream("hoard", timeout=30) as second:
                    with pytest.raises(cxlrpc.ResourceExhausted, match="max_stream_bytes"):
                        for _ in range(STREAM_WINDOW):  # the third item passes 256 KiB
                            await second.send(item)
                        await second.response()
                for _ in range(5):  # 200 KiB: over what the first connection has left
                    await bystander.send(item)
                await bystander.done_writing()
                assert await bystander.response() == [[len(item), b"x"]] * 5
        assert await until(lambda: not server._streams.stream_bytes, 5), server._streams.stream_bytes
    with pytest.raises(ValueError, match="max_stream_bytes"):
        cxlrpc.Server(url, max_stream_bytes=0)
