"""kvservice data safety: nothing a client held or reserved outlives it, whatever the timing."""
from __future__ import annotations

import asyncio
import gc
import math
import time

import pytest

import cxlrpc
from kvservice import ABSENT, LEASED, REMOVED, KVClient, KVServer, LeaseExpired, SyncKVClient

MiB = 1 << 20
pytestmark = pytest.mark.timeout(60)


async def until(cond, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_closed_clients_leases_end_when_a_new_client_takes_the_slot_at_once(url):
    """A client closes holding leases and the next client claims its slot immediately: the
    server still sees the first one leave and drops its leases (not after their expiry)."""
    async with KVServer(url, pool_size=8 * MiB, slots=1, default_lease_s=60.0) as server:
        async with KVClient.connect(url) as kv:
            await kv.put(b"k", b"v" * 100_000)
        for _ in range(5):
            first = await KVClient.connect(url)
            held = [await first.get(b"k") for _ in range(3)]  # never released by the user
            assert server.stats()["leases"] == 3
            await first.close()
            async with KVClient.connect(url) as second:  # the same slot, its next generation
                assert await second.exists(b"k")
                assert await until(lambda: server.stats()["leases"] == 0, 2.0), server.stats()
            del held


@pytest.mark.parametrize("size", [1000, 1 * MiB], ids=["inline", "two-phase"])
async def test_cancelled_puts_leave_nothing_behind_and_never_commit(url, size):
    """Puts abandoned by asyncio.wait_for, and cancelled after each number of loop turns, at
    every point of their flight (before the request, during begin, during commit): once the
    dust settles no reservation is left and no key of theirs exists, so the whole pool is free
    for the next put. (The turns make the points certain: a put is quicker than most timeouts.)"""
    async with KVServer(url, pool_size=40 * MiB, put_timeout_s=60.0) as server:
        async with KVClient.connect(url) as kv:
            late: set[str] = set()  # the RPCs whose replies came after their caller gave up
            take_back = kv._take_back

            def seen_late(step, outcome):
                if not isinstance(outcome, BaseException):
                    late.add(step.method)
                take_back(step, outcome)

            kv._take_back = seen_late
            timeouts = ([("wait_for", t) for t in (1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)]
                        + [("turns", n) for n in range(8)]) * 2
            cancelled = 0
            for i, (how, after) in enumerate(timeouts):
                try:
                    if how == "wait_for":
                        await asyncio.wait_for(kv.put(b"k%d" % i, bytes([i]) * size), after)
                    else:
                        task = asyncio.ensure_future(kv.put(b"k%d" % i, bytes([i]) * size))
                        for _ in range(after):
                            await asyncio.sleep(0)
                        task.cancel()
                        await task
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    cancelled += 1
            # cancelled before the request (after no turn), and while each RPC was in flight
            assert cancelled >= 2 and late == ({"inline"} if size < MiB else {"begin", "commit"}), \
                (cancelled, late)
            await kv.exists(b"sync")  # one round trip after the undo messages
            assert await until(lambda: server.stats()["pending_puts"] == 0, 3.0), server.stats()
            present = [i for i in range(len(timeouts)) if await kv.exists(b"k%d" % i)]
            # only puts whose caller saw them succeed may remain
            stats = server.stats()
            assert stats["evictions"] == 0  # the pool holds every put: none went missing
            assert stats["entries"] == len(present)
            assert stats["entries"] == len(timeouts) - cancelled, (present, cancelled)
            assert stats["pool_used"] == stats["entries"] * -(-size // 4096) * 4096  # no reservation
            await kv.put(b"big", b"x" * (35 * MiB - stats["pool_used"]))  # nothing pins the rest
            assert (await kv.get_bytes(b"big"))[:1] == b"x"


async def _fill(url: str, count: int, size: int) -> None:
    """Another client fills the pool with fresh keys (evicting what no lease protects)."""
    async with KVClient.connect(url) as other:
        for i in range(count):
            await other.put(b"fill-%d" % i, bytes([i % 251 + 1]) * size)


async def test_block_read_after_its_lease_lapsed_raises_instead_of_returning_other_bytes(url):
    """A blocking client holds a Block past its lease (not renewed) while another client fills
    the pool: every access then raises LeaseExpired; none returns another key's bytes."""
    async with KVServer(url, pool_size=4 * MiB, default_lease_s=0.3, expire_interval=0.05) as server:
        async with KVClient.connect(url) as kv:
            await kv.put(b"mine", b"\xaa" * MiB)
        sync = await asyncio.to_thread(SyncKVClient.connect, url)
        try:
            block = await asyncio.to_thread(sync.get, b"mine")
            assert block.tobytes() == b"\xaa" * MiB
            await asyncio.sleep(0.5)  # the scenario: the lease lapses while the block is held
            await _fill(url, 12, MiB)
            assert not server.index.exists("", b"mine")  # it was evicted and its bytes reused
            for read in (block.view, block.tobytes, lambda: block.copy_into(bytearray(MiB)),
                         block.array, block.check):
                with pytest.raises(LeaseExpired):
                    read()
            block.release()
        finally:
            await asyncio.to_thread(sync.close)


async def test_held_block_is_renewed_and_keeps_its_bytes(url):
    """The asyncio client renews a held block's lease: held for 4 lease lives while the pool
    is refilled, it is never evicted and reads back its own bytes."""
    async with KVServer(url, pool_size=4 * MiB, default_lease_s=0.3, expire_interval=0.05) as server:
        async with KVClient.connect(url) as kv:
            await kv.put(b"mine", b"\xbb" * MiB)
            with await kv.get(b"mine") as block:
                for _ in range(4):
                    await asyncio.sleep(0.3)
                    await _fill(url, 4, MiB)
                assert block.tobytes() == b"\xbb" * MiB
                assert server.stats()["leases"] == 1
            assert await until(lambda: server.stats()["leases"] == 0, 2.0)


async def test_dropped_block_releases_its_lease_and_leases_are_bounded(url):
    async with KVServer(url, pool_size=4 * MiB, default_lease_s=30.0, max_lease_s=60.0) as server:
        async with KVClient.connect(url) as kv:
            await kv.put(b"k", b"v" * 50_000)
            block = await kv.get(b"k")
            assert server.stats()["leases"] == 1
            del block  # never released by the user: collected
            gc.collect()
            assert await until(lambda: server.stats()["leases"] == 0, 2.0), server.stats()
            for bad in (math.inf, 61.0, 0.0, -1.0):
                with pytest.raises(cxlrpc.InvalidArgument):
                    await kv.get(b"k", lease_s=bad)
            with await kv.get(b"k", lease_s=60.0) as block:
                assert len(block) == 50_000


async def test_if_absent_put_batch_remove_with_leases_remove_matching_and_batch_exists(url):
    """Server-side semantics the Mooncake facade builds on, decided atomically by the server."""
    async with KVServer(url, pool_size=8 * MiB) as server:
        async with KVClient.connect(url) as a, KVClient.connect(url) as b:
            for size in (100, 100_000):  # inline and two-phase
                k = b"k%d" % size
                assert await a.put(k, b"1" * size, if_absent=True) is True
                assert await b.put(k, b"2" * size, if_absent=True) is False
                assert await b.get_bytes(k) == b"1" * size  # the first value stays
                assert await b.put(k, b"3" * size) is True  # a plain put replaces
            assert await a.batch_put({b"x1": b"a", b"k100": b"b"}, if_absent=True) == [True, False]
            held = await b.get(b"x1")  # another client's lease
            assert await a.batch_remove([b"x1", b"nope"], force=False) == [LEASED, ABSENT]
            assert await a.exists(b"x1")
            assert await a.batch_remove([b"x1"], force=True) == [REMOVED]
            assert held.tobytes() == b"a"  # the reader keeps its bytes
            held.release()
            await a.batch_put({b"log-1": b"1", b"log-2": b"2", b"keep": b"3"})
            assert await a.batch_exists([b"log-1", b"keep", b"gone"]) == [True, True, False]
            assert await a.lookup_keys([b"log-1", b"log-2", b"gone", b"keep"]) == 2
            assert await a.remove_matching("^log-") == 2
            assert await a.batch_exists([b"log-1", b"log-2", b"keep"]) == [False, False, True]
            with pytest.raises(cxlrpc.InvalidArgument, match="regular expression"):
                await a.remove_matching("(")
            assert await a.remove_matching(None) >= 1
            assert server.stats()["entries"] == 0


async def test_a_release_sent_after_a_server_restart_ends_no_lease_of_the_new_server(url):
    """A block held while its server restarts is released after the client reconnected to the
    new one, and the release reaches the new server before the next get. Each server numbers
    its leases from its own random start, so the old id names no lease of the new server (had
    both counted from 1, it would be the id of the lease the client got there first, in the
    same order of calls): it is ignored as stale."""
    async with KVServer(url, pool_size=8 * MiB):
        async with KVClient.connect(url) as writer:
            await writer.put(b"k", b"1" * 5000)
        kv = await KVClient.connect(url)
        held = await kv.get(b"k")
    try:
        async with KVServer(url, pool_size=8 * MiB) as second:
            async with KVClient.connect(url) as writer:
                await writer.put(b"k", b"2" * 5000)
            new = await _get_once_reconnected(kv, b"k")
            assert second.stats()["leases"] == 1
            held.release()
            with await kv.get(b"k"):
                stats = second.stats()
                assert stats["leases"] == 2 and stats["stale_releases"] == 1, stats
            new.release()
            assert await until(lambda: second.stats()["leases"] == 0, 2.0), second.stats()
    finally:
        await kv.close()


async def _get_once_reconnected(kv: KVClient, key: bytes):
    """``kv.get(key)``, retried while the client has not yet seen its server go (Unavailable);
    the first call after that reconnects."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        try:
            return await kv.get(key)
        except cxlrpc.Unavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.02)


async def test_a_client_reconnected_to_a_restarted_server_maps_the_new_pool(url):
    """cxlrpc reconnects a client to a restarted server on its next call; the server refuses
    a connection that has not said hello (it would read and write the old server's unlinked
    pool, whose block versions also count from 1: the old value passed every check). The
    client says hello, maps the new pool, and the refused operation runs anew."""
    async with KVServer(url, pool_size=8 * MiB):
        kv = await KVClient.connect(url)
        await kv.put(b"k", b"1" * 5000)
        await kv.put(b"big", b"a" * MiB)
        held = await kv.get(b"k")  # a block held across the restart keeps reading the old pool
    try:
        async with KVServer(url, pool_size=8 * MiB) as second:
            async with KVClient.connect(url) as writer:
                await writer.put(b"k", b"2" * 5000)
            block = await _get_once_reconnected(kv, b"k")
            with block:
                assert block.tobytes() == b"2" * 5000
            assert held.tobytes() == b"1" * 5000
            held.release()
            assert not await kv.exists(b"big")  # the new server never had it
            await kv.put(b"big", b"b" * MiB)  # two-phase: written into the new pool
            await kv.put(b"small", b"s" * 100)  # inline
            async with KVClient.connect(url) as reader:
                assert await reader.get_bytes(b"big") == b"b" * MiB
                assert await reader.get_bytes(b"small") == b"s" * 100
            blocks = [b async for b in kv.iter_get([b"k", b"big"])]
            assert [b.tobytes()[:1] for b in blocks] == [b"2", b"b"]
            for b in blocks:
                b.release()
            assert await until(lambda: second.stats()["leases"] == 0, 2.0), second.stats()
    finally:
        await kv.close()


async def test_a_sync_client_reconnected_to_a_restarted_server_maps_the_new_pool(url):
    def first_session() -> SyncKVClient:
        kv = SyncKVClient.connect(url)
        kv.put(b"k", b"1" * 5000)
        assert kv.get_bytes(b"k") == b"1" * 5000
        return kv

    async with KVServer(url, pool_size=8 * MiB):
        kv = await asyncio.to_thread(first_session)
    try:
        async with KVServer(url, pool_size=8 * MiB):
            async with KVClient.connect(url) as writer:
                await writer.put(b"k", b"2" * 5000)

            def after_restart() -> bytes:
                deadline = time.monotonic() + 5.0
                while True:
                    try:
                        return kv.get_bytes(b"k")
                    except cxlrpc.Unavailable:  # not yet seen its server go
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.02)

            assert await asyncio.to_thread(after_restart) == b"2" * 5000
            await asyncio.to_thread(kv.put, b"big", b"b" * MiB)
            async with KVClient.connect(url) as reader:
                assert await reader.get_bytes(b"big") == b"b" * MiB
    finally:
        kv.close()


async def test_a_connection_that_never_said_hello_is_refused(url):
    """A peer that skips hello (it cannot know which pool is this server's) gets
    FAILED_PRECONDITION from every operation, and nothing is leased or reserved for it."""
    async with KVServer(url, pool_size=8 * MiB) as server:
        async with KVClient.connect(url) as kv:
            await kv.put(b"k", b"v" * 5000)
        async with cxlrpc.connect(url) as raw:
            for method, arg in (("get", ["", [b"k"], None, 0.0]), ("exists", ["", b"k"]),
                                ("begin", ["", [b"x"], [10], None])):
                with pytest.raises(cxlrpc.FailedPrecondition, match="has not said hello"):
                    await raw.call(method, arg, timeout=5)
            with pytest.raises(cxlrpc.FailedPrecondition, match="has not said hello"):
                async for _ in raw.stream("get_stream", ["", [b"k"], None, 8], timeout=5):
                    pass
            assert server.stats()["leases"] == 0 and server.stats()["pending_puts"] == 0


async def test_released_leases_leave_no_renewal_timers_behind(url):
    """Each held block is renewed until released or collected; releasing it ends that (a
    renewal timer per get, left pending for half a lease's life, piled up by the ten
    thousand under load): one timer serves every held block."""
    async with KVServer(url, pool_size=4 * MiB) as server, KVClient.connect(url) as kv:
        await kv.put(b"k", b"v" * 5000)
        held = await kv.get(b"k")
        for _ in range(500):
            with await kv.get(b"k"):
                pass
        blocks = await kv.batch_get([b"k"] * 10)
        del blocks  # collected: their timers go too
        gc.collect()
        assert await until(lambda: len(kv._held) == 1)  # the held block's
        held.release()
        assert not kv._held
        assert await until(lambda: server.stats()["leases"] == 0, 2.0), server.stats()


def test_a_collected_blocks_release_is_never_pushed_by_the_collector(url):
    """The collector may run inside one of the client's pushes: a collected block's release
    only joins the queue (the next call, or the loop's next turn, sends it)."""
    async def run() -> None:
        async with KVServer(url, pool_size=4 * MiB) as server, KVClient.connect(url) as kv:
            await kv.put(b"k", b"v" * 5000)
            pushes = []
            real = kv.rpc.send_nowait
            kv.rpc.send_nowait = lambda *a, **k: (pushes.append(a[0]), real(*a, **k))[1]
            blocks = await kv.batch_get([b"k"] * (2 * 64))
            del blocks
            gc.collect()  # 128 collected: before, the 64th flushed from inside the collector
            assert pushes == [] and len(kv._released) == 128
            assert await until(lambda: server.stats()["leases"] == 0, 2.0), server.stats()
            assert pushes == ["release", "release"]  # sent when the loop turned

        def sync_side() -> None:
            with KVClient.connect_sync(url) as kv:
                blocks = kv.batch_get([b"k"] * 100)
                del blocks
                gc.collect()
                assert len(kv._released) == 100  # queued, not sent by the collector
                assert kv.exists(b"k")  # the next call sends them first
                assert not kv._released

        async with KVServer(url, pool_size=4 * MiB) as server:
            async with KVClient.connect(url) as kv:
                await kv.put(b"k", b"v" * 5000)
            await asyncio.to_thread(sync_side)
            assert server.stats()["leases"] == 0

    asyncio.run(run())


async def test_block_held_across_restart_on_a_file_pool_never_reads_the_new_servers_bytes(url, tmp_path):
    """A pool on a file (or DAX device) is the same memory for the next server. A client's
    Block from the first server keeps checking the version word of that memory; the second
    server numbers versions from 1 again, so its first value at the same offset gets the
    very version the old Block holds: the check passes and the old Block returns the new
    server's bytes (another value) instead of raising LeaseExpired."""
    pool_url = f"file://{tmp_path}/pool"
    async with KVServer(url, pool_size=8 * MiB, pool_url=pool_url):
        async with KVClient.connect(url) as writer:
            await writer.put(b"k", b"1" * 5000)
        kv = await KVClient.connect(url)
        held = await kv.get(b"k")
    try:
        async with KVServer(url, pool_size=8 * MiB, pool_url=pool_url):
            async with KVClient.connect(url) as writer:
                await writer.put(b"other-key", b"2" * 5000)  # same offset, version 1 again
            try:
                data = held.tobytes()
            except LeaseExpired:
                data = None
            assert data is None or data == b"1" * 5000, (
                f"a Block of the old server returned another value's bytes: {data[:8]!r}...")
            held.release()
    finally:
        await kv.close()


async def test_a_writer_past_its_put_timeout_cannot_overwrite_another_keys_live_value(url):
    """begin_put hands the writer a writable view of the block; when put_timeout_s passes the
    server frees that block and hands it to the next put, which commits it. The first
    writer's view still writes into it (nothing revokes or checks it), so the other key's
    committed value changes under its readers, whose version check passes."""
    async with KVServer(url, pool_size=8 * MiB, put_timeout_s=0.2, expire_interval=0.02) as server:
        async with KVClient.connect(url) as slow, KVClient.connect(url) as other:
            pending = await slow.begin_put("slow", 5000)
            assert await until(lambda: server.stats()["pending_puts"] == 0)  # ticket expired
            await other.put("victim", b"v" * 5000)  # takes the freed block
            try:
                pending.view()[:] = b"x" * 5000  # the slow writer goes on filling its block
            except (ValueError, TypeError, LeaseExpired):
                pass  # refused: fine
            try:
                data = await other.get_bytes("victim")
            except LeaseExpired:
                data = None
            assert data == b"v" * 5000, f"victim's value now reads {data[:8]!r}..."
            assert server.stats()["expired_puts_held"] == 1  # the slow writer's block, kept
            with pytest.raises(cxlrpc.NotFound):
                await pending.commit()
            assert server.stats()["expired_puts_held"] == 0  # freed by the refused commit
            await other.remove("victim")
            assert await until(lambda: server.stats()["pool_used"] == 0)
            # a writer that departs instead frees its expired block too
            await slow.begin_put("slow2", 5000)
            assert await until(lambda: server.stats()["expired_puts_held"] == 1)
        assert await until(lambda: server.stats()["pool_used"] == 0)


def test_a_lease_naming_bytes_outside_the_pool_or_off_its_units_gives_no_view(name):
    """A lease is read from a reply (hostile ground): one whose block is not a unit of the pool,
    or whose range leaves it, raises RegionError before any view is made."""
    from cxlrpc.region import RegionError
    from kvservice.pool import Pool

    pool = Pool.create(f"shm://{name}.pool", 1 * MiB, 4096)
    try:
        cap = pool.capacity
        for offset, size in ((-4096, 8), (cap, 1), (100, 8), (4096, 0), (cap - 4096, 4097),
                             (4096, cap)):
            with pytest.raises(RegionError):
                pool.leased(offset, size, 1, None, 7)
        block = pool.leased(cap - 4096, 4096, 0, None, 7)  # the last unit, whole
        assert block.size == 4096 and block.view().readonly
        block.release()
    finally:
        pool.retire()
        pool.close()
