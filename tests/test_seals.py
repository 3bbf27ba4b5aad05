"""Seals of followed extents (cxlrpc.heap): a client never writes on, nor returns the bytes of,
an extent whose seal says it is no longer its own (the server reaped it and, past the
quarantine, handed the extent to another) — the native paths and the reference alike."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

import cxlrpc
from cxlrpc import memory
from cxlrpc.heap import FOLLOW_HEADER, SEAL_AT, SEAL_BROKEN, SEAL_REVOKED, seal_word
from cxlrpc.memory import FOLLOW_CHUNK, RELEASE, AtomicMemory, SealBroken, follow_copy, publish_copy
from procs import followed_server, made

MiB = 1 << 20
MINE, OTHERS = seal_word(3, 7), seal_word(4, 1)


def _extent(length: int) -> tuple[bytearray, memoryview, AtomicMemory]:
    buf = bytearray(FOLLOW_HEADER + length)
    mem = AtomicMemory(buf)
    mem.store(SEAL_AT, MINE, RELEASE)
    return buf, memoryview(buf), mem


def test_seal_words_are_odd_distinct_and_as_the_native_caller_makes_them() -> None:
    words = {seal_word(slot, gen) for slot in range(64) for gen in range(1, 64)}
    assert len(words) == 64 * 63 and all(w & 1 for w in words) and SEAL_REVOKED not in words
    # (the native caller's follow_seal: the test below sees it accept the server's seal)


@pytest.mark.parametrize("when", ["before", "mid"])
def test_a_writer_stops_once_the_seal_is_not_its_own(copies: str, when: str) -> None:
    """Nothing written past the check that sees another's seal: not the body, not the
    progress word (mid: the seal changes after the first chunk, reference path only)."""
    if when == "mid" and copies == "native":
        pytest.skip("the native copy cannot be paused mid-write; 'before' covers its check")
    length = 4 * FOLLOW_CHUNK
    buf, view, mem = _extent(length)
    if when == "before":
        mem.store(SEAL_AT, OTHERS, RELEASE)
        target = mem
    else:
        class Resealed:  # a new owner's seal lands right after the first progress store
            def __getattr__(self, name):
                return getattr(mem, name)

            def store(self, at, value, order):
                mem.store(at, value, order)
                if at == 0:
                    mem.store(SEAL_AT, OTHERS, RELEASE)
        target = Resealed()
    with pytest.raises(SealBroken):
        publish_copy(target, view, 0, FOLLOW_HEADER, b"\xab" * length, SEAL_AT, MINE)
    written = 0 if when == "before" else FOLLOW_CHUNK
    assert mem.load(0, memory.ACQUIRE) == written
    assert bytes(buf[FOLLOW_HEADER + written:]) == bytes(length - written)


def test_a_writer_with_its_seal_writes_all(copies: str) -> None:
    length = 3 * FOLLOW_CHUNK + 5
    buf, view, mem = _extent(length)
    body = os.urandom(length)
    publish_copy(mem, view, 0, FOLLOW_HEADER, body, SEAL_AT, MINE)
    assert mem.load(0, memory.ACQUIRE) == length and bytes(buf[FOLLOW_HEADER:]) == body


def test_a_reader_refuses_a_body_resealed_while_it_copied(copies: str) -> None:
    """The writer publishes half, the extent is sealed for another, then the rest: the reader
    copies it all, re-reads the seal and raises instead of returning the bytes."""
    length = 8 * MiB
    buf, view, mem = _extent(length)
    body = os.urandom(length)
    half = threading.Event()

    def writer() -> None:
        publish_copy(mem, view, 0, FOLLOW_HEADER, body[:length // 2])
        half.wait(10)
        mem.store(SEAL_AT, OTHERS, RELEASE)
        view[FOLLOW_HEADER + length // 2:] = body[length // 2:]
        mem.store(0, length, RELEASE)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        class Watched:  # lets the writer on once the reader has started following
            def __getattr__(self, name):
                return getattr(mem, name)

            def load(self, at, order):
                half.set()
                return mem.load(at, order)
        target = Watched() if copies != "native" else mem
        if copies == "native":
            half.set()
        with pytest.raises(SealBroken):
            follow_copy(target, view, 0, FOLLOW_HEADER, length, 5.0, 30.0, SEAL_AT, MINE)
    finally:
        half.set()
        thread.join(10)
    assert follow_copy(mem, view, 0, FOLLOW_HEADER, length, 5.0, 30.0, SEAL_AT, OTHERS) == body


@pytest.mark.parametrize("path", ["native", "reference"])
async def test_a_reply_resealed_mid_follow_is_unavailable(name: str, copies: str, path: str) -> None:
    """A server child rewrites the seal of a followed reply's extent half way (as the owner a
    reused extent would have): the caller raises Unavailable, native caller or reference; the
    next calls are served."""
    url = f"shm://{name}"
    with followed_server(url):
        client = await cxlrpc.connect(url)
        try:
            for method, arg in (("make", [10, 0]), ("publish", "whole")):
                await client.call(method, arg, timeout=30)  # (a method's first call names it)
            if path == "reference":
                client._conn.caller = None
            elif client._conn.caller is None:
                pytest.skip("cxlrpc._dispatch was not built")
            await client.call("publish", "reseal", timeout=30)
            with pytest.raises(cxlrpc.Unavailable, match="seal is not this client's"):
                await client.call("make", [4 * MiB, 1], timeout=30)
            await client.call("publish", "whole", timeout=30)
            assert await client.call("make", [4 * MiB, 2], timeout=30) == made(4 * MiB, 2)
        finally:
            await client.close()


async def test_a_native_writer_never_writes_into_a_spare_no_longer_its_own(name: str) -> None:
    """The native caller's followed request through its spare extent: sealed for another
    (as after its reaping), it writes nothing there and raises Unavailable."""
    url = f"shm://{name}"
    server = cxlrpc.Server(url)

    @server.method("echo")
    def echo(body: bytes) -> bytes:
        return body

    async with server, cxlrpc.connect(url) as client:
        if client._conn.caller is None:
            pytest.skip("cxlrpc._dispatch was not built")
        body = os.urandom(MiB)
        assert await client.call("echo", body, timeout=30) == body  # ALLOCs a spare, kept
        assert client._bodies.spare is not None
        offset = client._bodies.spare[0]
        heap = client._bodies.heap
        at = heap.start + offset
        heap.mem.store(at + SEAL_AT, OTHERS, RELEASE)
        heap.mem.store(at, 12345, RELEASE)  # a progress word the writer would zero, then move
        view = heap.buf[at + FOLLOW_HEADER:at + FOLLOW_HEADER + MiB]
        before = bytes(view)
        with pytest.raises(cxlrpc.Unavailable, match="seal is not this client's"):
            await client.call("echo", os.urandom(MiB), timeout=30)
        assert bytes(view) == before  # not a byte of the body written
        assert heap.mem.load(at, memory.ACQUIRE) == 12345  # nor its progress word
        view.release()


def test_the_server_seals_what_it_hands_out_and_revokes_what_it_takes_back() -> None:
    """Sealed for its owner when handed out (a followed reply's extent, an ALLOC asked for a
    followed request); revoked when the owner departs (quarantined, kept till fenced) and
    whenever the server frees it (a request it gave up while its writer may write on)."""
    from cxlrpc.heap import HeapAccess, ServerHeap

    buf = bytearray(16 * MiB)
    mem = AtomicMemory(buf)
    heap = ServerHeap(HeapAccess(memoryview(buf), mem, 0, len(buf)), spare_budget=0)
    seal = lambda offset: mem.load(offset + SEAL_AT, memory.ACQUIRE)  # noqa: E731
    request = heap.alloc(1, 5, FOLLOW_HEADER + MiB, keep=True)  # (no spare budget: freed once read)
    reply = heap.alloc_reply(1, 5, FOLLOW_HEADER + MiB)
    other = heap.alloc_reply(2, 9, FOLLOW_HEADER + MiB)
    assert seal(request) == seal(reply) == seal_word(1, 5) and seal(other) == seal_word(2, 9)
    heap.lend(request)
    assert heap.give_back(request) and seal(request) == SEAL_REVOKED  # given up, freed: revoked
    used = heap.used
    heap.quarantine(1, 5)
    assert seal(reply) == SEAL_REVOKED and heap.used == used  # kept, but no longer its owner's
    assert seal(other) == seal_word(2, 9)
    assert heap.release_owner(1, 5) == 1 and heap.used == used - heap._alloc.rounded(FOLLOW_HEADER + MiB)


def test_a_request_the_server_gives_up_is_freed_only_once_its_writer_stopped() -> None:
    """A followed request abandoned mid-write (stall, deadline, cancel) while its client still
    holds its slot: its writer may write on, so the extent is freed only once its progress word
    says the writer stopped (done, or gave up), not when the server stops reading."""
    from cxlrpc.heap import FOLLOW_ABORTED, HeapAccess, ServerHeap

    buf = bytearray(16 * MiB)
    mem = AtomicMemory(buf)
    heap = ServerHeap(HeapAccess(memoryview(buf), mem, 0, len(buf)), spare_budget=0)
    for stops_with in (MiB, FOLLOW_ABORTED):
        offset = heap.alloc(1, 5, FOLLOW_HEADER + MiB, keep=True)
        heap.lend(offset)  # (as the server does while it follows the body)
        mem.store(offset, FOLLOW_CHUNK, RELEASE)  # one chunk written so far
        assert not heap.abandon(offset, MiB)
        assert heap.used > 0 and heap.free_abandoned() == 0
        assert heap.alloc(2, 1, 16 * MiB - FOLLOW_HEADER) is None  # not handed to another
        mem.store(offset, stops_with, RELEASE)
        assert heap.free_abandoned() == 1 and heap.used == 0
