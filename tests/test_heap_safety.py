"""The heap path against misuse and bad timing: a lent extent is never freed or reused under
its handler, a grant that comes after its caller gave up is given back, bodies over a heap
smaller than max_message_size are refused (not wedged or lost), and a stream item for a
departed caller leaks no extent."""
from __future__ import annotations

import asyncio
import hashlib

import pytest

import cxlrpc
from cxlrpc import frame as fr
from cxlrpc.heap import EXTENT, GRANT, OFFSET
from procs import until

pytestmark = pytest.mark.timeout(60)
KiB, MiB = 1 << 10, 1 << 20
SMALL = dict(request_capacity=64 * KiB, response_capacity=64 * KiB)


async def _outcome(aw):
    """What ``aw`` returns, or the exception it raises (plain asserts keep reports short)."""
    try:
        return await aw
    except (Exception, asyncio.TimeoutError) as exc:
        return exc


def _holding_server(url: str, **opts) -> tuple[cxlrpc.Server, asyncio.Event, asyncio.Event, list]:
    """A server whose ``hold`` handler reads its lent heap body only after ``go`` is set."""
    server = cxlrpc.Server(url, **{**SMALL, "max_message_size": MiB, "heap_size": MiB, **opts})
    entered, go, seen = asyncio.Event(), asyncio.Event(), []

    @server.method("hold")
    async def hold(data: memoryview) -> bytes:
        entered.set()
        await go.wait()
        seen.append(bytes(data))
        return hashlib.sha256(data).digest()

    @server.method("digest")
    def digest(data: bytes) -> bytes:
        return hashlib.sha256(data).digest()

    @server.method("echo")
    async def echo(data: bytes) -> bytes:
        return data

    @server.method("make")
    def make(size: int) -> bytes:
        return b"m" * size

    return server, entered, go, seen


async def test_a_free_of_a_lent_extent_does_not_hand_it_to_another_connection(url):
    """A (buggy or hostile) client FREEs the extent its own suspended handler still reads: the
    server must refuse (the extent is lent), not hand it to the next ALLOC of another client,
    whose body the handler would then read (and whose extent its give_back would free)."""
    server, entered, go, seen = _holding_server(url)
    size = 600 * KiB  # two do not fit the 1 MiB heap
    mine, theirs = b"A" * size, b"B" * size
    async with server, cxlrpc.connect(url) as a, cxlrpc.connect(url) as b:
        held = asyncio.ensure_future(a.call("hold", mine, timeout=30))
        await asyncio.wait_for(entered.wait(), 10)
        (offset,) = server._bodies.heap._lent
        dropped, used = server.dropped_frames, server._bodies.heap.used
        chan = a._conn.chan
        free = fr.header(fr.FREE, fr.RAW, 0, chan.slot, chan.gen, fr.NO_REPLY, 0.0, b"")
        assert chan.push((free, OFFSET.pack(offset)))
        chan.server_bell.ring()
        assert await until(lambda: server.dropped_frames != dropped or server._bodies.heap.used != used, 5)
        other = asyncio.ensure_future(b.call("digest", theirs, timeout=30))
        await until(lambda: other.done(), 0.5)  # B must wait for room (or be done if the bug)
        go.set()
        assert await asyncio.wait_for(other, 30) == hashlib.sha256(theirs).digest()
        await asyncio.wait((held,), timeout=30)
        assert [s[:4] for s in seen] == [mine[:4]], "the lent handler read another connection's request bytes"
        assert await until(lambda: server._bodies.heap.used == 0, 5), server._bodies.heap.used


async def test_an_extent_named_by_two_requests_is_not_freed_while_lent(url):
    """A client names its one granted extent in two requests: the first (a lent, suspended
    handler) keeps reading it; the second must not free it under the first."""
    server, entered, go, seen = _holding_server(url)
    size = 600 * KiB
    mine, theirs = b"A" * size, b"B" * size
    async with server, cxlrpc.connect(url) as a, cxlrpc.connect(url) as b:
        loop = asyncio.get_running_loop()
        alloc_id, alloc = a._bodies.alloc_request(size, 10.0)
        offset, _ = GRANT.unpack(await a._roundtrip(alloc_id, alloc, None, None))
        a._bodies.heap.write(offset, (mine,))
        chan = a._conn.chan
        futs = {}
        for call_id, method in ((9001, b"hold"), (9002, b"digest")):
            futs[call_id] = loop.create_future()
            a._replies.pending[call_id] = (futs[call_id], None)
            head = fr.HEADER.pack(fr.REQUEST, fr.RAW | fr.HEAP, 0, chan.slot, chan.gen, call_id,
                                  30.0, len(method))
            assert chan.push((head, method, EXTENT.pack(offset, size)))
            chan.server_bell.ring()
            if method == b"hold":
                await asyncio.wait_for(entered.wait(), 10)
        # the second request is refused or served; either way the extent stays the handler's
        await asyncio.wait((futs[9002],), timeout=10)
        other = asyncio.ensure_future(b.call("digest", theirs, timeout=30))
        await until(lambda: other.done(), 0.5)
        go.set()
        assert await asyncio.wait_for(other, 30) == hashlib.sha256(theirs).digest()
        await asyncio.wait((futs[9001],), timeout=10)
        assert [s[:4] for s in seen] == [mine[:4]], "the lent handler read another connection's request bytes"
        assert await until(lambda: server._bodies.heap.used == 0, 5), server._bodies.heap.used


async def test_an_alloc_granted_after_its_caller_gave_up_is_freed(url):
    """The caller of a big request is cancelled while its ALLOC waits for heap space, and the
    server grants the extent before it reads the CANCEL: the client must FREE the late grant
    (``_allocs`` is for that), else the extent is lost for as long as the client is
    connected (here: the whole heap, every later big call of every client waits)."""
    server, entered, go, seen = _holding_server(url)
    size = 600 * KiB
    async with server, cxlrpc.connect(url) as a, cxlrpc.connect(url) as b:
        held = asyncio.ensure_future(a.call("hold", b"A" * size, timeout=30))
        await asyncio.wait_for(entered.wait(), 10)
        waiting = asyncio.ensure_future(b.call("digest", b"B" * size))
        assert await until(lambda: server._bodies.heap_waiting, 5)
        go.set()          # the holder finishes: its extent comes back, B's ALLOC is granted
        waiting.cancel()  # ... while B gives up (its CANCEL is read after the grant went out)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(held, 10)
        assert await until(lambda: server._bodies.heap.used == 0, 3), \
            f"{server._bodies.heap.used} bytes of heap leaked: {server._bodies.heap._owners}"
        assert await b.call("digest", b"C" * size, timeout=5) == hashlib.sha256(b"C" * size).digest()


async def test_a_request_bigger_than_the_heap_is_refused_not_wedged(url):
    """heap_size below max_message_size is accepted: a request that can never fit the heap
    must be refused (RESOURCE_EXHAUSTED), not wedge the queue of ALLOCs for everyone."""
    server, *_ = _holding_server(url, heap_size=256 * KiB)
    async with server, cxlrpc.connect(url) as a, cxlrpc.connect(url) as b:
        big = asyncio.ensure_future(a.call("digest", b"x" * (512 * KiB)))
        await asyncio.sleep(0)
        small = b"y" * (100 * KiB)  # past the ring, fits the heap
        got = await _outcome(b.call("digest", small, timeout=5))
        assert got == hashlib.sha256(small).digest(), f"a small heap call behind it: {got!r}"
        got = await _outcome(asyncio.wait_for(big, 5))
        assert isinstance(got, cxlrpc.ResourceExhausted), f"the too-big request: {got!r}"


async def test_a_reply_bigger_than_the_heap_is_refused_not_lost(url):
    server, *_ = _holding_server(url, heap_size=256 * KiB)
    async with server, cxlrpc.connect(url) as a:
        got = await _outcome(a.call("make", 512 * KiB, timeout=5))
        assert isinstance(got, cxlrpc.ResourceExhausted), f"the too-big reply: {got!r}"


async def test_a_stream_item_sent_after_its_caller_left_does_not_leak_an_extent(url):
    """A stream handler that yields a big item right after its caller departed (before the
    cancel the departure scheduled reaches it): the extent must not outlive the departure."""
    server = cxlrpc.Server(url, **SMALL, max_message_size=MiB)
    started, left = asyncio.Event(), []
    server.on_disconnect(lambda peer: left.append(peer))

    @server.method("items")
    async def items(n: int):
        started.set()
        while not left:
            await asyncio.sleep(0)
        yield b"s" * (200 * KiB)  # past the ring: through the heap

    async with server:
        client = await cxlrpc.connect(url)
        stream = client.stream("items", 1, timeout=30)
        reading = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait_for(started.wait(), 10)
        await client.close()
        await asyncio.wait((reading,), timeout=10)
        assert await until(lambda: left, 5)
        assert await until(lambda: server._bodies.heap.used == 0, 3), \
            f"{server._bodies.heap.used} bytes of heap leaked: {server._bodies.heap._owners}"


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
async def test_frees_are_taken_by_the_native_dispatcher_and_bad_ones_dropped(name, monkeypatch, native):
    """The FREE a client sends after reading a followed reply goes from the native dispatcher
    straight to the server's _free_extent (no frame decoded by the reference); a FREE from the
    slot's previous generation, or of an extent that is not the sender's, is dropped either way
    and frees nothing."""
    url = f"shm://{name}"
    server = cxlrpc.Server(url, max_message_size=4 * MiB, heap_size=8 * MiB)
    server.add_method("echo", lambda data: data)
    if not native:
        monkeypatch.setattr(server._calls, "_dispatcher", lambda *args: None)
    by_reference, freed = [], []
    on_request, free_extent = server._calls._on_request, server._calls._free_extent

    def spy_request(view):
        by_reference.append(view[0])
        on_request(view)

    def spy_free(offset, slot, gen):
        freed.append(offset)
        free_extent(offset, slot, gen)

    monkeypatch.setattr(server._calls, "_on_request", spy_request)
    monkeypatch.setattr(server._calls, "_free_extent", spy_free)
    payload = bytes(range(256)) * (4 * KiB)  # 1 MiB: its reply is followed, then FREEd
    async with server, cxlrpc.connect(url) as client:
        if native and server._calls._fast is None:
            pytest.skip("the native dispatcher was not built")
        for _ in range(5):
            assert await client.call("echo", payload, timeout=30) == payload
        assert await until(lambda: len(freed) >= 5, 5), freed  # (an extent stays parked for the next reply)
        assert by_reference.count(fr.FREE) == (0 if native else len(freed))
        chan = client._conn.chan
        (dropped, used), n = (server.dropped_frames, server._bodies.heap.used), len(freed)
        held = asyncio.ensure_future(client.call("echo", payload, timeout=30))  # an extent in use
        for gen, offset in ((chan.gen + 1, 0), (chan.gen, 64 * KiB + 8)):  # not this holder's; no extent
            free = fr.header(fr.FREE, fr.RAW, 0, chan.slot, gen, fr.NO_REPLY, 0.0, b"")
            assert chan.push((free, OFFSET.pack(offset)))
        chan.server_bell.ring()
        assert await until(lambda: server.dropped_frames >= dropped + 2, 5), server.dropped_frames - dropped
        assert await held == payload
        assert await until(lambda: server._bodies.heap.used == used, 5), server._bodies.heap.used
        assert len(freed) - n in (1, 2)  # the echo's own FREE, and the never-granted extent's try


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
async def test_big_replies_are_followed_by_the_native_dispatcher_and_the_rest_by_the_reference(
        name, monkeypatch, native):
    """A big reply (bytes, bytearray, a memoryview of any shape, an encoded result; from a plain
    or an async handler) is followed by the native dispatcher without the reference's
    _push_followed; a reply meeting a full response ring (held back, then sent, its extent not
    leaked) and a reply while ALLOCs wait for the heap are the reference's."""
    url = f"shm://{name}"
    server = cxlrpc.Server(url, max_message_size=4 * MiB, heap_size=8 * MiB)
    server.add_method("echo", lambda data: data)
    server.add_method("bytearray", lambda data: bytearray(data))
    server.add_method("view", lambda data: memoryview(data))
    server.add_method("strided", lambda data: memoryview(data)[::2])
    server.add_method("words", lambda data: memoryview(data).cast("Q"))
    server.add_method("encoded", lambda data: {"data": data})

    @server.method("fill_then_echo")
    def fill_then_echo(data: bytes) -> bytes:
        """Fill the caller's response ring (with replies to no call), then answer."""
        slot, gen = cxlrpc.current_peer()
        junk = fr.header(fr.RESPONSE, fr.RAW, 0, slot, gen, 1 << 60, 0.0, b"")
        for size in (64 * KiB, 0):  # (down to room for no record at all)
            while server._chan.responses[slot].try_push_parts((junk, b"j" * size)):
                pass
        return data

    @server.method("async_echo")
    async def async_echo(data: bytes) -> bytes:
        return data

    if not native:
        monkeypatch.setattr(server._calls, "_dispatcher", lambda *args: None)
    followed = []  # what each call of the reference's _push_followed returned

    def spy(*args):
        followed.append(push_followed(*args))
        return followed[-1]

    push_followed = server._replies.push_followed
    monkeypatch.setattr(server._replies, "push_followed", spy)
    payload = bytes(range(256)) * (4 * KiB)  # 1 MiB: past FOLLOW_MIN
    async with server, cxlrpc.connect(url) as client:
        if native and server._calls._fast is None:
            pytest.skip("the native dispatcher was not built")
        # (the first big request goes through an ALLOC, not a spare extent, and the reference
        # dispatches it)
        assert await client.call("echo", payload, timeout=30) == payload
        followed.clear()
        for method in ("echo", "bytearray", "view", "async_echo"):
            assert await client.call(method, payload, timeout=30) == payload, method
        assert await client.call("encoded", payload, timeout=30) == {"data": payload}
        # (views of any shape are sent as their bytes: 512 KiB, still followed)
        assert await client.call("strided", payload, timeout=30) == payload[::2]
        assert await client.call("words", payload, timeout=30) == payload
        assert followed == ([] if native else [True] * 7), followed
        followed.clear()

        # ALLOCs waiting for the heap: a reply takes the ring, not the heap
        heap_freed = server._bodies.heap_freed
        monkeypatch.setattr(server._bodies, "heap_freed", lambda: None)  # (so the waiter stays)
        server._bodies.heap_waiting.append((None, client._conn.chan.slot, client._conn.chan.gen + 1, 1, MiB, 0))
        assert await client.call("echo", payload, timeout=30) == payload
        assert followed == [None], followed
        server._bodies.heap_waiting.clear()
        monkeypatch.setattr(server._bodies, "heap_freed", heap_freed)
        followed.clear()

        # a full response ring: the reply is held back until the client has read what fills it
        used = server._bodies.heap.used  # (the client's spare extent)
        assert await client.call("fill_then_echo", payload, timeout=30) == payload
        assert followed[0] is False and followed[-1] is True, followed
        assert await until(lambda: server._bodies.heap.used == used, 5), (server._bodies.heap.used, used)
