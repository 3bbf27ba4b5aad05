"""kvservice end to end: the shm service (async and blocking clients) and its gRPC twin; the
shm service also on the simulator of memory without coherence (sim://, flush mode)."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import numpy as np
import pytest

import cxlrpc
import cxlrpc.simulator
from kv_workers import check_value, churn_main, hold_lease_main, make_value
from kvservice import KeyNotFound, KVClient, KVServer, chunk_keys
from kvservice import wire as w
from kvservice.grpc_twin import GrpcKVClient, GrpcKVServer
from kvservice.pool import CLAIM_CHECK_EVERY, Block, PutFenced
from procs import CTX, stop

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def until(cond, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll the async predicate ``cond()`` until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(interval)
    return bool(await cond())


async def stat(kv, name: str):
    return (await kv.stats())[name]


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


@pytest.fixture(params=["shm", "sim", "grpc"])
async def service(request, name):
    """(server, asyncio client) for the shm service (coherent and simulated) and its gRPC twin."""
    if request.param != "grpc":
        url = f"{request.param}://{name}"
        async with KVServer(url, pool_size=64 * MiB) as server, KVClient.connect(url) as kv:
            yield server, kv
    else:
        async with GrpcKVServer("127.0.0.1:0", 64 * MiB) as server, \
                GrpcKVClient(server.address) as kv:
            yield server, kv


# ---- the API, on both services -------------------------------------------------------------

async def test_every_call(service):
    server, kv = service
    await kv.put("a", b"alpha")
    await kv.put(b"arr", np.arange(50_000, dtype=np.float32))  # two-phase on shm (> 64 KiB)
    assert await kv.get_bytes("a") == b"alpha"
    with await kv.get("arr") as block:
        assert block.size == 200_000
        np.testing.assert_array_equal(block.array(np.float32, (100, 500)).ravel(),
                                      np.arange(50_000, dtype=np.float32))
        assert bytes(block.view()[:4]) == np.float32(0).tobytes()
    out = bytearray(300_000)
    assert await kv.get_into("arr", out) == 200_000
    assert out[:200_000] == np.arange(50_000, dtype=np.float32).tobytes()
    with pytest.raises(ValueError):
        await kv.get_into("arr", bytearray(10))
    await kv.batch_put({"b1": b"x" * 10, "b2": os.urandom(100_000), "b3": np.ones(3, np.int64)})
    blocks = await kv.batch_get(["b1", "missing", "b3"])
    assert blocks[1] is None
    assert blocks[0].tobytes() == b"x" * 10 and blocks[2].array(np.int64).tolist() == [1, 1, 1]
    for b in (blocks[0], blocks[2]):
        b.release()
    assert await kv.exists("a") and not await kv.exists("nope")
    assert await kv.remove("a") is True and await kv.remove("a") is False
    assert not await kv.exists("a")
    with pytest.raises(KeyError) as err:
        await kv.get("a")
    assert isinstance(err.value, KeyNotFound) and isinstance(err.value, cxlrpc.NotFound)
    with pytest.raises(KeyError):
        await kv.get_bytes("a")
    tokens = list(range(1000))
    keys = chunk_keys(tokens, 256)
    await kv.batch_put({k: np.full(16, i, np.int16) for i, k in enumerate(keys[:2])})
    assert await kv.lookup_prefix(tokens, 256) == 2
    assert await kv.lookup_prefix(tokens[:100], 256) == 0
    stats = await kv.stats()
    assert stats["hits"] >= 4 and stats["misses"] >= 2
    assert stats["namespaces"][""]["bytes"] > 0 and "evictions" in stats


async def test_namespaces_are_isolated(service):
    _, kv = service
    await kv.put("k", b"in A", namespace="A")
    assert await kv.exists("k", namespace="A")
    assert not await kv.exists("k", namespace="B") and not await kv.exists("k")
    with pytest.raises(KeyError):
        await kv.get_bytes("k", namespace="B")
    await kv.put("k", b"in B", namespace="B")
    assert await kv.get_bytes("k", namespace="A") == b"in A"
    assert await kv.remove("k", namespace="B")
    assert await kv.get_bytes("k", namespace="A") == b"in A"
    tokens = np.arange(512)
    await kv.batch_put({k: b"kv" for k in chunk_keys(tokens, 256, "A")}, namespace="A")
    assert await kv.lookup_prefix(tokens, 256, namespace="A") == 2
    assert await kv.lookup_prefix(tokens, 256, namespace="B") == 0
    assert set((await kv.stats())["namespaces"]) == {"A"}


async def test_quota_and_bad_arguments(service):
    server, kv = service
    server.set_quota("small", 64 << 10)
    await kv.put("a", bytes(60_000), namespace="small")
    with pytest.raises(cxlrpc.ResourceExhausted):
        await kv.put("big", bytes(100_000), namespace="small")
    with pytest.raises(cxlrpc.InvalidArgument):
        await kv.put("huge", np.zeros(65 * MiB, np.uint8))  # larger than the whole pool
    with pytest.raises(ValueError):
        await kv.put("", b"x")
    with pytest.raises(ValueError):
        await kv.put("empty", b"")
    with pytest.raises(TypeError):
        await kv.put(3, b"x")


async def test_ttl(service):
    _, kv = service
    await kv.put("short", b"soon gone", ttl=0.2)
    await kv.put("long", b"stays", ttl=60)
    assert await kv.exists("short")
    assert await until(lambda: _absent(kv, "short"), timeout=5)
    assert await kv.exists("long")
    assert (await kv.stats())["expirations"] >= 1


async def _absent(kv, key) -> bool:
    return not await kv.exists(key)


# ---- the shared-memory service: leases, two-phase puts, eviction ------------------------------

async def test_overwrite_keeps_leased_bytes_until_release(url):
    async with KVServer(url, pool_size=8 * MiB) as server, KVClient.connect(url) as kv:
        old = make_value(b"k", 1, 1, 200_000)
        await kv.put("k", old)
        block = await kv.get("k")
        await kv.put("k", make_value(b"k", 2, 2, 200_000))
        await kv.remove("k")
        await kv.put("k", make_value(b"k", 3, 3, 200_000))  # may reuse nothing the lease holds
        assert bytes(block.view()) == old and check_value(b"k", block.view()) == (1, 1)
        assert check_value(b"k", await kv.get_bytes("k")) == (3, 3)
        assert server.index.stats()["retired_blocks"] == 1
        block.release()
        with pytest.raises(ValueError):
            block.view()
        assert await until(lambda: _retired_none(kv), timeout=5)


async def _retired_none(kv) -> bool:
    stats = await kv.stats()
    return stats["retired_blocks"] == 0 and stats["leases"] == 0


async def test_value_invisible_before_commit(url):
    async with KVServer(url, pool_size=8 * MiB), KVClient.connect(url) as kv:
        await kv.put("k", b"old")
        pending = await kv.begin_put("k", 1000)
        pending.array(np.int8)[:] = 7
        assert not await kv.exists("new") and await kv.get_bytes("k") == b"old"
        assert (await kv.stats())["pending_puts"] == 1
        await pending.commit()
        assert await kv.get_bytes("k") == bytes([7]) * 1000
        pending = await kv.begin_put("gone", 10)
        assert not await kv.exists("gone")
        await pending.abort()
        assert not await kv.exists("gone") and (await kv.stats())["pending_puts"] == 0


async def test_pool_full_then_room_after_release(url):
    async with KVServer(url, pool_size=1 * MiB), KVClient.connect(url) as kv:
        blocks = []
        for i in range(4):  # four 256 KiB values fill the pool; leases make them unevictable
            await kv.put(f"v{i}", bytes([i]) * (256 << 10))
            blocks.append(await kv.get(f"v{i}"))
        with pytest.raises(cxlrpc.ResourceExhausted):
            await kv.put("more", b"x" * 100_000)
        assert all(b.view()[0] == i for i, b in enumerate(blocks))
        blocks[1].release()
        assert await until(lambda: _leases(kv, 3))
        await kv.put("more", b"x" * 100_000)  # evicts the one unleased value
        assert not await kv.exists("v1") and await kv.exists("v0")
        assert (await kv.stats())["evictions"] == 1
        for b in blocks:
            b.release()


async def _leases(kv, n: int) -> bool:
    return (await kv.stats())["leases"] == n


async def test_eviction_is_lru_and_skips_leased_blocks(url):
    async with KVServer(url, pool_size=1 * MiB), KVClient.connect(url) as kv:
        for i in range(12):  # 12 x 64 KiB = 75% of the pool
            await kv.put(f"a{i}", bytes([i]) * (64 << 10))
        pinned = await kv.get("a0")          # the oldest, but leased
        with await kv.get("a1"):             # touched: now the most recent of the a's
            pass
        assert await until(lambda: _leases(kv, 1))
        for i in range(3):  # crosses the 90% high watermark: evicts down to 80%
            await kv.put(f"b{i}", bytes(64 << 10))
        stats = await kv.stats()
        assert stats["evictions"] == 3
        assert await kv.exists("a0") and await kv.exists("a1")
        assert [await kv.exists(f"a{i}") for i in (2, 3, 4, 5)] == [False, False, False, True]
        assert pinned.view()[5] == 0
        pinned.release()


async def test_killed_client_releases_its_lease(url):
    async with KVServer(url, pool_size=8 * MiB, default_lease_s=120), \
            KVClient.connect(url) as kv:
        await kv.put("k", b"v" * 5000)
        ready = CTX.Event()
        proc = CTX.Process(target=hold_lease_main, args=(url, b"k", ready), daemon=True)
        proc.start()
        try:
            assert await asyncio.to_thread(ready.wait, 20), "lease holder did not start"
            assert (await kv.stats())["leases"] == 1
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.join, 10)
            t0 = time.monotonic()
            assert await until(lambda: _leases(kv, 0), timeout=10), "dead client's lease kept"
            assert time.monotonic() - t0 < 5
            assert (await kv.stats())["lease_expirations"] == 0  # released, not expired
        finally:
            await asyncio.to_thread(stop, proc)


async def test_concurrent_processes_never_read_torn_or_stale_values(url):
    async with KVServer(url, pool_size=256 * MiB, slots=8) as server:
        results = CTX.Queue()
        procs = [CTX.Process(target=churn_main, args=(url, wid, 5.0, 6, results), daemon=True)
                 for wid in (1, 2, 3)]
        for p in procs:
            p.start()
        try:
            reports = [await asyncio.to_thread(results.get, True, 40) for _ in procs]
            for p in procs:
                await asyncio.to_thread(p.join, 10)
        finally:
            for p in procs:
                await asyncio.to_thread(stop, p)
        errors = [r for r in reports if not isinstance(r[1], dict)]
        assert not errors, errors
        assert all(p.exitcode == 0 for p in procs)
        for _, counts in reports:
            assert counts["puts"] > 10 and counts["reads"] > 10, counts
        stats = server.stats()
        assert stats["pending_puts"] == 0
        assert await until(_no_leases(server), timeout=5)


def _no_leases(server):
    async def check() -> bool:
        return server.stats()["leases"] == 0
    return check


async def test_server_validates_requests(url):
    async with KVServer(url, pool_size=1 * MiB) as server, cxlrpc.connect(url) as rpc, \
            cxlrpc.connect(url) as other:
        for peer in (rpc, other):  # a connection must say hello before anything else
            await peer.call("hello", response_type=w.Hello)
        for bad in (w.Begin("", [b"k"], [0]), w.Begin("", [b"k"], [-5]),
                    w.Begin("", [b"k"], [2 * MiB]), w.Begin("", [b"k", b"j"], [10]),
                    w.Begin("", [b""], [10]), w.Inline("", [b"k"], [])):
            with pytest.raises(cxlrpc.InvalidArgument):
                await rpc.call(bad.__class__.__name__.lower(), bad)
        with pytest.raises(cxlrpc.InvalidArgument):
            await rpc.call("get", {"not": "a Get"})
        (ticket,) = await rpc.call("begin", w.Begin("", [b"k"], [10]), response_type=list[w.PutTicket])
        with pytest.raises(cxlrpc.NotFound):  # another client cannot commit my ticket
            await other.call("commit", w.Tickets([ticket.ticket_id]))
        with pytest.raises(cxlrpc.NotFound):
            await rpc.call("commit", w.Tickets([ticket.ticket_id + 1000]))
        await rpc.call("commit", w.Tickets([ticket.ticket_id]))
        (lease,) = await rpc.call("get", w.Get("", [b"k"]), response_type=list[w.Lease | None])
        await other.call("release", w.Release([lease.lease_id]))  # not its lease: ignored
        assert server.stats()["leases"] == 1
        await rpc.call("release", w.Release([lease.lease_id]))
        assert server.stats()["leases"] == 0


async def test_block_views_fail_safely(url):
    async with KVServer(url, pool_size=1 * MiB):
        async with KVClient.connect(url) as kv:
            await kv.put("k", b"abc" * 1000)
            block = await kv.get("k")
            view, arr = block.view(), block.array()
            assert view.readonly and not arr.flags.writeable
            with pytest.raises(ValueError):
                kv.pool.slice(kv.pool.capacity - 10, 11)  # an offset outside the pool is refused
            block.release()
            block.release()  # idempotent
            with pytest.raises(ValueError):
                view[0]
            held = await kv.get("k")
            kept = held.view()
        # the client and then the server closed under a view the user still holds
        assert kept.nbytes == 3000
        held.release()
    assert not os.path.exists(f"/dev/shm/cxlrpc.{url[6:]}.pool")


async def test_big_values_round_trip_through_every_copy(url):
    """Values past the sizes where copies switch to streaming stores (into the pool from
    STREAM_COLD_MIN, out of it from STREAM_WARM_MIN), at odd lengths: put, get_into, get_bytes
    and the zero-copy view all see the bytes put."""
    from cxlrpc.memory import STREAM_COLD_MIN, STREAM_WARM_MIN
    async with KVServer(url, pool_size=32 * MiB) as server, KVClient.connect(url) as kv:
        for size in (STREAM_COLD_MIN + 3, STREAM_WARM_MIN + 4097):
            value = os.urandom(size)
            await kv.put("big", value)
            out = np.zeros(size + 10, np.uint8)
            assert await kv.get_into("big", out) == size
            assert out[:size].tobytes() == value and not out[size:].any()
            assert await kv.get_bytes("big") == value
            with await kv.get("big") as block:
                assert block.view() == value
        assert await until(_no_leases(server), timeout=5)


# ---- lease releases ride on the next request ---------------------------------------------------

async def test_each_release_rides_on_the_next_get_so_a_get_is_one_message(url):
    """N get-and-release cycles (get, get_into, get_bytes, batch_get mixed) are N messages: the
    server has ended the last block's lease when it answers the next get, and has received no
    release message of its own; the last release goes out one-way once the loop turns."""
    async with KVServer(url, pool_size=8 * MiB) as server, KVClient.connect(url) as kv:
        sizes = {"a": 5000, "b": 200_000}
        await kv.batch_put({k: k.encode() * n for k, n in sizes.items()})
        out = bytearray(200_000)
        hits = server.stats()["hits"]
        for i in range(60):
            key = "ab"[i % 2]
            if i % 3 == 0:
                with await kv.get(key) as block:
                    assert block.view()[0] == ord(key)
            elif i % 3 == 1:
                assert await kv.get_into(key, out) == sizes[key]
            else:
                (block,) = await kv.batch_get([key])
                with block:
                    assert block.tobytes()[-1] == ord(key)
            stats = server.stats()
            assert stats["leases"] == 1 and stats["release_messages"] == 0, (i, stats)
        assert server.stats()["hits"] - hits == 60
        assert await until(_stats_are(server, leases=0, release_messages=1), timeout=2)
        assert server.stats()["lease_expirations"] == 0


def _stats_are(server, **want):
    async def check() -> bool:
        stats = server.stats()
        return all(stats[k] == v for k, v in want.items())
    return check


async def test_releases_no_request_follows_go_out_in_batches_soon(url):
    """A release with no request after it is sent within about half a millisecond; 100 released
    at once are two messages (the 64th sends 64 at once, the timer the rest); one released in
    another thread is sent by the loop."""
    async with KVServer(url, pool_size=8 * MiB) as server, KVClient.connect(url) as kv:
        keys = [f"k{i}" for i in range(100)]
        await kv.batch_put({k: b"v" * 100 for k in keys})
        with await kv.get("k0"):
            pass
        assert await until(_stats_are(server, leases=0, release_messages=1), timeout=2)
        blocks = await kv.batch_get(keys)
        for block in blocks:
            block.release()
        assert await until(_stats_are(server, leases=0, release_messages=3), timeout=2)
        block = await kv.get("k1")
        await asyncio.to_thread(block.release)
        assert await until(_stats_are(server, leases=0, release_messages=4), timeout=2)
        assert server.stats()["stale_releases"] == 0


@pytest.mark.parametrize("pool,size", [(32 << 10, 20 << 10), (1 * MiB, 600 << 10)],
                         ids=["inline", "two-phase"])
async def test_a_release_riding_on_a_put_frees_room_for_that_put(url, pool, size):
    """A pool with room for one value: each put evicts the value just read, which only the
    release riding on that put (ended before the put reserves its block) lets it do."""
    async with KVServer(url, pool_size=pool) as server, KVClient.connect(url) as kv:
        await kv.put("v0", bytes([0]) * size)
        for i in range(1, 6):
            with await kv.get(f"v{i - 1}") as block:
                assert block.view()[size - 1] == i - 1
            await kv.put(f"v{i}", bytes([i]) * size)
        stats = server.stats()
        assert stats["evictions"] == 5 and stats["release_messages"] == 0 and stats["leases"] == 0
        assert await kv.exists("v5") and not await kv.exists("v4")


async def test_releases_of_a_failed_get_are_queued_again(url):
    """A get the server refuses still had its releases taken: they are queued again and sent
    one-way (the server had ended the lease already, so the repeat counts as stale)."""
    async with KVServer(url, pool_size=1 * MiB, max_lease_s=60.0) as server, \
            KVClient.connect(url) as kv:
        await kv.put("k", b"v" * 100)
        with await kv.get("k"):
            pass
        with pytest.raises(cxlrpc.InvalidArgument):
            await kv.get("k", lease_s=61.0)
        assert await until(_stats_are(server, leases=0, release_messages=1, stale_releases=1),
                           timeout=2)


async def test_a_get_answered_with_two_leases_ends_both_and_raises(url):
    """A server that breaks the protocol (two leases for one key) leaks no lease: the client
    ends both and says what happened."""
    async with KVServer(url, pool_size=1 * MiB) as server, KVClient.connect(url) as kv:
        await kv.batch_put({"a": b"1" * 100, "b": b"2" * 100})
        real = kv.rpc.call

        async def two_keys(method, arg=None, **options):
            if method == "get":
                arg = w.Get(arg.ns, [b"a", b"b"], arg.lease_s, arg.hold_s, arg.release)
            return await real(method, arg, **options)

        kv.rpc.call = two_keys
        with pytest.raises(cxlrpc.Internal, match="one key with 2 leases"):
            await kv.get("a")
        del kv.rpc.call
        assert await kv.get_bytes("b") == b"2" * 100  # carries the two releases
        assert await until(_stats_are(server, leases=0), timeout=2), server.stats()


# ---- the blocking client and the command line -------------------------------------------------

async def test_blocking_client(url):
    async with KVServer(url, pool_size=8 * MiB):
        def run() -> None:
            with KVClient.connect_sync(url) as kv:
                kv.put("s", b"sync")
                kv.put("big", np.arange(100_000, dtype=np.int32), namespace="n")
                assert kv.get_bytes("s") == b"sync"
                with kv.get("big", namespace="n") as block:
                    assert block.array(np.int32)[-1] == 99_999
                out = np.empty(100_000, np.int32)
                assert kv.get_into("big", out, namespace="n") == 400_000 and out[7] == 7
                kv.batch_put({"x": b"1", "y": b"2"})
                x, z, y = kv.batch_get(["x", "z", "y"])
                assert (x.tobytes(), z, y.tobytes()) == (b"1", None, b"2")
                x.release()
                y.release()
                assert kv.exists("x") and kv.remove("x") and not kv.exists("x")
                with pytest.raises(KeyNotFound):
                    kv.get("x")
                pending = kv.begin_put("p", 4)
                pending.view()[:] = b"wxyz"
                assert not kv.exists("p")
                pending.commit()
                assert kv.get_bytes("p") == b"wxyz"
                tokens = list(range(600))
                kv.batch_put({k: b"c" for k in chunk_keys(tokens, 256)})
                assert kv.lookup_prefix(tokens) == 2
                stats = kv.stats()
                assert stats["leases"] == 0 and stats["namespaces"]["n"]["entries"] == 1

        await asyncio.wait_for(asyncio.to_thread(run), 30)


async def test_blocking_client_sends_releases_with_its_next_call(url):
    """The blocking client queues releases: one rides on the next get or put, goes out one-way
    before any other call and when 64 are queued; while the client sits idle, a released
    block stays leased until its lease's term ends."""
    async with KVServer(url, pool_size=8 * MiB, expire_interval=0.05):
        def run() -> None:
            with KVClient.connect_sync(url) as kv, KVClient.connect_sync(url) as watch:
                kv.put("k", b"v" * 5000)
                for _ in range(10):
                    with kv.get("k") as block:
                        assert block.view()[0] == ord("v")
                    stats = watch.stats()  # the last release is queued, the others rode
                    assert stats["leases"] == 1 and stats["release_messages"] == 0, stats
                kv.put("j", b"w" * 100)
                assert watch.stats()["leases"] == 0
                with kv.get("k"):
                    pass
                assert kv.exists("k")
                stats = watch.stats()
                assert stats["leases"] == 0 and stats["release_messages"] == 1, stats
                with kv.get("k", lease_s=0.3):
                    pass
                assert watch.stats()["leases"] == 1
                assert _wait(lambda: watch.stats()["leases"] == 0, 3.0)
                assert watch.stats()["lease_expirations"] == 1
                keys = [f"c{i}" for i in range(64)]
                kv.batch_put({k: b"c" for k in keys})
                for block in kv.batch_get(keys):
                    block.release()
                assert _wait(lambda: watch.stats()["leases"] == 0, 3.0)
                assert watch.stats()["release_messages"] == 2

        await asyncio.wait_for(asyncio.to_thread(run), 30)


def _wait(cond, timeout: float) -> bool:
    """Poll the predicate ``cond()`` until it holds or ``timeout`` passes (blocking)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def test_stats_command(url, name):
    async with KVServer(url, pool_size=1 * MiB), KVClient.connect(url) as kv:
        await kv.put("k", b"v", namespace="ns")
        where = ["--name", name] if url.startswith("shm://") else ["--url", url]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvservice", "stats", *where, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, err.decode()
        assert '"ns"' in out.decode() and '"hits"' in out.decode()


def test_block_over_plain_bytes():
    block = Block(memoryview(b"\x01\x00\x02\x00"))
    assert block.array(np.uint16).tolist() == [1, 2] and len(block) == 4


async def test_serve_command_with_quotas_and_stats_of_one_namespace(tmp_path):
    """`serve` takes the service URL, pool, slots, quotas and timeouts as flags; `stats
    --namespace` shows that namespace only."""
    url = f"file://{tmp_path}/kv"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvservice", "serve", "--url", url, "--pool-size", "8MiB",
        "--quota", "a=2MiB", "--quota", "=1MiB", "--slots", "4", "--client-timeout", "2.5",
        "--fence-timeout", "30", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"quota a=2097152" in line, line
        assert b"client timeout 2.5 s, fence timeout 30.0 s" in line, line
        async with KVClient.connect(url) as kv:
            await kv.put("k", b"v" * 10, namespace="b")
            mine = await kv.stats("a")
            assert mine["namespaces"] == {"a": {"bytes": 0, "entries": 0, "quota": 2 * MiB}}
            assert set((await kv.stats())["namespaces"]) == {"a", "", "b"}
        out = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvservice", "stats", "--url", url, "--namespace", "b", cwd=ROOT,
            stdout=asyncio.subprocess.PIPE)
        text, _ = await asyncio.wait_for(out.communicate(), 30)
        assert '"b"' in text.decode() and '"a"' not in text.decode()
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def test_iter_get_streams_blocks_in_order_as_they_are_found(url):
    """A server stream of leases, a chunk per item: every key's block (None for a miss), in
    order, readable in place; leases end as the blocks are released."""
    async with KVServer(url, pool_size=8 * MiB) as server, KVClient.connect(url) as kv:
        values = {f"k{i}": bytes([i]) * (1000 + i) for i in range(20)}
        await kv.batch_put(values)
        keys = [*values][:10] + ["missing"] + [*values][10:]
        seen = []
        async for block in kv.iter_get(keys, chunk=3):
            if block is None:
                seen.append(None)
                continue
            with block:
                seen.append(block.tobytes())
        assert seen == [*list(values.values())[:10], None, *list(values.values())[10:]]
        assert await until(lambda: _leases(kv, 0))
        with pytest.raises(cxlrpc.InvalidArgument, match="chunk"):
            async for _ in kv.iter_get(keys, chunk=0):
                pass
        assert server.stats()["pending_puts"] == 0


async def test_a_failing_expiry_pass_is_logged_and_expiry_goes_on(caplog):
    """The server's periodic expiry outlives a pass that raises (a bug there must not stop
    leases and TTLs from ending for good, nor surface as an error at close)."""
    url = f"shm://kvexp{os.getpid()}"
    server = KVServer(url, 1 << 20, expire_interval=0.01)
    passes = []

    def expire() -> int:
        passes.append(None)
        if len(passes) == 1:
            raise RuntimeError("broken pass")
        return 0

    server.index.expire = expire
    async with server:
        deadline = time.monotonic() + 5
        while len(passes) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    assert len(passes) >= 3
    assert "lease/TTL expiry pass failed" in caplog.text



# ---- memory without coherence: a reserved block given back carries none of its writer's lines --

def _dirty_lines(pool, offset: int, size: int):
    """The lines of the pool block [offset, offset+size) that this client's simulated cache
    holds dirty: (line numbers, their contents)."""
    sim = pool.region._sim
    lines = sim._lines(pool._data_offset + offset, size)
    dirty = (sim._cache[lines] != sim._clean[lines]).any(axis=1)
    return lines.start + np.flatnonzero(dirty), sim._cache[lines][dirty].copy()


async def _give_back(how: str, wkv, server, size: int):
    """W reserves a ``size``-byte block, fills it with 0xAA and gives it back unpublished
    ``how``: an abort, a put whose copy failed midway (its error path) or a close. Returns the
    lines W's host still held dirty when the close let the block go (they land later there)."""
    if how == "failed put":
        checks = iter([True])  # the first claim check passes, the next finds the claim gone
        wkv.pool.claimed = lambda offset, ticket_id: next(checks, False)
        with pytest.raises(PutFenced):
            await wkv.put("w", b"\xaa" * size)
        del wkv.pool.claimed
        return None
    pending = await wkv.begin_put("w", size)
    pending.view()[:] = b"\xaa" * size
    if how == "abort":
        await pending.abort()
        return None
    (ticket,) = server.index._puts.tickets.values()
    held = []
    detach = wkv.rpc.close

    async def close_rpc() -> None:  # what W's cache holds dirty as its server frees the block
        held.append(_dirty_lines(wkv.pool, ticket.block.offset, size))
        await detach()
    wkv.rpc.close = close_rpc
    await wkv.close()
    return held[0]


@pytest.mark.parametrize("how", ["abort", "failed put", "close"])
async def test_a_reserved_block_given_back_is_written_back_first(name, how, monkeypatch):
    """Issue 42: a writer that gave a reserved block back without writing its lines back kept
    them dirty in its cache; when they landed (its next invalidate of the block, as clflushopt
    does, an eviction, or later on its host after a close) they overwrote the block's next
    value, and readers took them for it (its version unchanged). Every way of giving a block
    back writes the writer's lines back first."""
    monkeypatch.setattr(cxlrpc.simulator, "EVICTION_RATE", 0.0)  # lines land only when told
    url = f"sim://{name}"
    size = (CLAIM_CHECK_EVERY if how == "failed put" else 0) + (64 << 10)
    victim = make_value(b"victim", 1, 1, size)
    async with KVServer(url, pool_size=16 * MiB) as server, \
            KVClient.connect(url) as x, KVClient.connect(url) as r, \
            KVClient.connect(url) as wkv:
        held = await _give_back(how, wkv, server, size)
        assert await until(_stats_are(server, pending_puts=0, quarantined_blocks=0))
        await x.put("victim", victim)
        assert await r.get_bytes("victim") == victim
        if held is None:
            with await wkv.get("victim") as block:  # W's invalidate: its dirty lines land first
                assert bytes(block.view()) == victim
        else:  # W closed: the lines its host still held dirty land now
            lines, contents = held
            r.pool.region._sim._mem[lines] = contents
        assert await r.get_bytes("victim") == victim
        assert await x.get_bytes("victim") == victim
