"""kvservice fencing: a client frozen (SIGSTOP) and reaped by the server cannot, on resuming,
change another key's bytes nor read them as its own (issue 40, item 3)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal

import pytest

import cxlrpc
from kv_workers import late_get_main, late_put_main
from kvservice import KVClient, KVServer, PutFenced
import procs
from procs import CTX, stop

MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)
#: a reaped client is judged gone after this long without a heartbeat (the default is 1 s)
CLIENT_TIMEOUT = 0.5


async def until(cond, timeout: float = 20.0) -> bool:
    return await procs.until(cond, timeout, 0.02)


async def get_queue(queue, timeout: float = 30.0):
    """The next item of a multiprocessing queue, without blocking the loop the server runs on."""
    return await asyncio.get_running_loop().run_in_executor(None, queue.get, True, timeout)


def value(i: int, size: int) -> bytes:
    """Victim ``i``'s value: bytes no other key has (and none is 0xEE, the late writer's)."""
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=64).digest() * (size // 64)


async def fill(kv: KVClient, total: int, size: int) -> dict[str, bytes]:
    """Put ``total`` bytes of ``size``-byte values (more than the pool: every free range is
    reused, old victims evicted); the values put, by key."""
    put = {}
    for i in range(total // size):
        put[f"victim-{i}"] = value(i, size)
        await kv.put(f"victim-{i}", put[f"victim-{i}"])
    return put


async def changed_bytes(kv: KVClient, put: dict[str, bytes]) -> tuple[int, int]:
    """(bytes differing from what was put, values read) over the victims still stored."""
    changed = read = 0
    for key, data in put.items():
        try:
            got = await kv.get_bytes(key)
        except KeyError:
            continue  # evicted by a later victim
        read += 1
        changed += sum(a != b for a, b in zip(got, data)) if got != data else 0
    return changed, read


async def test_a_frozen_writer_resuming_after_it_was_reaped_changes_no_other_keys_bytes(url):
    """A writer frozen right after begin_put (SIGSTOP) is reaped; other writers then put more
    than the pool holds, so the allocator hands out every free range; the writer resumes
    (SIGCONT), fills its whole 8 MiB block and commits. Its block was quarantined, not freed:
    0 bytes of the other keys change, and its commit fails. Once its process is killed it is
    fenced and the block is freed (the pool empties)."""
    size, pool = 8 * MiB, 32 * MiB
    async with KVServer(url, pool_size=pool, client_timeout=CLIENT_TIMEOUT) as server:
        begun, go, outcome = CTX.Queue(), CTX.Event(), CTX.Queue()
        proc = CTX.Process(target=late_put_main, args=(url, b"late", size, begun, go, outcome),
                           daemon=True)
        proc.start()
        try:
            assert await get_queue(begun) == size
            os.kill(proc.pid, signal.SIGSTOP)
            go.set()  # seen once it resumes
            assert await until(lambda: server.stats()["pending_puts"] == 0), "not reaped"
            async with KVClient.connect(url) as kv:
                put = await fill(kv, 2 * pool, 1 * MiB)
                os.kill(proc.pid, signal.SIGCONT)
                result = await get_queue(outcome)
                changed, read = await changed_bytes(kv, put)
                assert read >= 8, f"only {read} victims left to check"
                assert changed == 0, f"{changed} bytes of other keys' values were overwritten"
                assert result in ("NotFound", "Unavailable"), f"its commit: {result}"
                assert not await kv.exists(b"late")
                stats = server.stats()
                assert stats["quarantined_blocks"] == 1 and stats["quarantined_bytes"] == size
                os.kill(proc.pid, signal.SIGKILL)  # now it is gone: fenced
                proc.join(10)
                fenced = await until(lambda: server.stats()["quarantined_blocks"] == 0)
                assert fenced, server.stats()
                await kv.batch_remove(list(put))
                assert await until(lambda: server.stats()["pool_used"] == 0), server.stats()
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
            stop(proc)


async def test_a_frozen_reader_resuming_after_it_was_reaped_never_returns_another_keys_bytes(url):
    """The read-side twin: a reader frozen holding a lease on an 8 MiB value is reaped (its
    lease ends at once: leases are not quarantined); the key is removed and its block reused by
    other keys; the reader resumes and copies the value out. Its copy's version check fails
    (LeaseExpired): it never returns the other keys' bytes as its own."""
    size, pool = 8 * MiB, 32 * MiB
    async with KVServer(url, pool_size=pool, client_timeout=CLIENT_TIMEOUT) as server:
        leased, go, outcome = CTX.Queue(), CTX.Event(), CTX.Queue()
        async with KVClient.connect(url) as kv:
            mine = value(99_999, size)
            await kv.put(b"read-me", mine)
            proc = CTX.Process(target=late_get_main, args=(url, b"read-me", leased, go, outcome),
                               daemon=True)
            proc.start()
            try:
                assert await get_queue(leased) == size
                os.kill(proc.pid, signal.SIGSTOP)
                go.set()
                assert await until(lambda: server.stats()["leases"] == 0), "not reaped"
                assert await kv.remove(b"read-me")
                put = await fill(kv, 2 * pool, 1 * MiB)
                os.kill(proc.pid, signal.SIGCONT)
                kind, digest = await get_queue(outcome)
                assert kind == "expired" or digest == hashlib.blake2b(mine).hexdigest(), (
                    "the resumed reader returned another key's bytes as its own")
                assert kind == "expired"  # its block was reused: the check must have failed
                assert (await changed_bytes(kv, put))[0] == 0
                await kv.batch_remove(list(put))
            finally:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGCONT)
                stop(proc)
        assert await until(lambda: server.stats()["pool_used"] == 0), server.stats()


async def test_a_writer_fenced_while_it_runs_stops_before_writing_into_a_reused_block(url):
    """The case a fence cannot prove: a writer on another host, frozen past fence_timeout, whose
    blocks were freed and reused (simulated here: the index releases and fences the writer's
    connection while it runs). Its claim on the block is gone, so a view it asks for, and the
    copy of a put whose block went between its begin and its copy, raise PutFenced and
    write nothing: the key that took the block keeps its bytes."""
    size = 8 * MiB
    async with KVServer(url, pool_size=size, high_watermark=1.0, low_watermark=1.0) as server:
        async with KVClient.connect(url) as writer:
            (peer,) = server._greeted

            def fenced() -> None:  # what the server does past fence_timeout
                server.index.release_owner(peer)
                server.index.fence_owner(peer)

            async with KVClient.connect(url) as other:
                pending = await writer.begin_put(b"late", size)
                pending.view()[:8] = b"\xee" * 8  # its own block: fine
                fenced()
                mine = value(1, size)
                await other.put(b"victim", mine)  # the whole pool: the writer's old block
                for hand_out in (pending.view, pending.array):
                    with pytest.raises(PutFenced):
                        hand_out()
                with pytest.raises(cxlrpc.NotFound):
                    await pending.commit()
                assert await other.get_bytes(b"victim") == mine
                await other.remove(b"victim")

                steps = writer._put({b"late2": b"\xee" * size}, "", None)  # driven by hand
                begin = next(steps)
                tickets = await writer.rpc.call(begin.method, begin.arg,
                                                response_type=begin.response_type)
                fenced()
                await other.put(b"victim", mine)
                abort = steps.send(tickets)  # the copy: refused before its first byte
                assert abort.method == "abort"
                with pytest.raises(PutFenced):
                    steps.send(None)
                assert await other.get_bytes(b"victim") == mine
                assert server.stats()["pool_used"] == size
