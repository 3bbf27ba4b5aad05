"""What a grpc.aio user expects of a client's life: a client dropped without close() frees its
slot when collected (with a ResourceWarning, leaving no thread, socket or mapping behind);
connect(wait_for_ready=...) waits for a server to appear; and a client whose server restarted
reconnects on its next call, while calls in flight at the restart fail with Unavailable."""
from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import threading
import time
import warnings

import pytest

import cxlrpc
from cxlrpc import client_connection
from cxlrpc.region import parse_url

from procs import echo_server, sized_for, until

pytestmark = pytest.mark.timeout(60)

MONITOR = "cxlrpc-client-monitor"


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


def make_server(url: str, **opts) -> cxlrpc.Server:
    server = cxlrpc.Server(url, **sized_for(url, opts))
    server.started = 0

    @server.method("echo")
    def echo(payload):
        return payload

    @server.method("slow")
    async def slow(seconds: float) -> float:
        server.started += 1
        await asyncio.sleep(seconds)
        return seconds

    return server


def monitors() -> int:
    return sum(t.name == MONITOR for t in threading.enumerate())


def mappings(url: str) -> int:
    """How many times this process maps the region's segment (the server's own included)."""
    path = "/dev/shm" + parse_url(url)[1]
    with open("/proc/self/maps") as f:
        return sum(line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)") == path
                   for line in f)


def wake_sockets() -> int:
    """How many client wake-up sockets (abstract ``@cxlrpc-EPOCH-cSLOT.GEN``) this process holds."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            ours.add(target[len("socket:["):-1])
    with open("/proc/net/unix") as f:
        next(f)
        rows = [line.split() for line in f]
    return sum(len(r) > 7 and r[6] in ours and re.fullmatch(r"@cxlrpc-[0-9a-f]+-c\d+\.\d+", r[7])
               is not None for r in rows)


# ------------------------------------------------------------------ 1. dropped clients
async def test_dropped_clients_free_their_slots(url):
    """Clients dropped without close() on a 2-slot server: each is collected with a
    ResourceWarning and frees its slot, so connecting goes on working; at the end no monitor
    thread, wake-up socket or mapping of theirs is left."""
    async with make_server(url, slots=2):
        threads, sockets, maps = monitors(), wake_sockets(), mappings(url)
        for i in range(6):
            client = await cxlrpc.connect(url)
            assert await client.call("echo", i, timeout=5) == i
            with pytest.warns(ResourceWarning, match="unclosed cxlrpc client Client"):
                del client
                gc.collect()
        assert await until(lambda: monitors() == threads, 5), "monitor threads outlived their clients"
        assert await until(lambda: mappings(url) == maps, 5), "dropped clients still map the region"
        assert await until(lambda: wake_sockets() == sockets, 5), "dropped clients' wake-up sockets are open"
        async with cxlrpc.connect(url) as a, cxlrpc.connect(url) as b:  # both slots are free
            assert await asyncio.gather(a.call("echo", 1, timeout=5), b.call("echo", 2, timeout=5)) == [1, 2]


async def test_dropped_blocking_clients_free_their_slots(url):
    async with make_server(url, slots=2):
        def churn() -> None:
            for i in range(6):
                client = cxlrpc.connect_sync(url)
                assert client.call("echo", i, timeout=5) == i
                del client
                gc.collect()

        threads = monitors()
        with pytest.warns(ResourceWarning, match="unclosed cxlrpc client SyncClient") as record:
            await asyncio.to_thread(churn)
        assert sum("unclosed cxlrpc client" in str(w.message) for w in record) == 6
        assert await until(lambda: monitors() == threads, 5)
        assert await until(lambda: mappings(url) == 1, 5)  # the server's own

        def both_slots() -> tuple:
            with cxlrpc.connect_sync(url) as a, cxlrpc.connect_sync(url) as b:
                return a.call("echo", 1, timeout=5), b.call("echo", 2, timeout=5)

        assert await asyncio.to_thread(both_slots) == (1, 2)


def test_client_dropped_after_its_loop_closed_is_released(name):
    """A client still open when its event loop ended (asyncio.run cancelled its reader) is
    released at once when dropped later: its monitor thread and its mapping."""
    url = f"shm://{name}"
    threads = monitors()

    async def main():
        async with make_server(url):
            client = await cxlrpc.connect(url)
            assert await client.call("echo", b"x", timeout=5) == b"x"
            return client

    client = asyncio.run(main())
    assert mappings(url) == 1 and monitors() == threads + 1
    with pytest.warns(ResourceWarning, match="unclosed cxlrpc client"):
        del client
        gc.collect()
    assert monitors() == threads and mappings(url) == 0


# ------------------------------------------------------------------ 2. wait_for_ready
async def test_wait_for_ready_connects_once_a_server_starts(url):
    async def connecting():
        return await cxlrpc.connect(url, wait_for_ready=20)

    task = asyncio.create_task(connecting())
    assert not await until(task.done, 0.3), "connect did not wait for a server"
    async with make_server(url):
        client = await asyncio.wait_for(task, 20)
        async with client:
            assert await client.call("echo", b"ready", timeout=5) == b"ready"


async def test_wait_for_ready_blocking_client(url):
    task = asyncio.create_task(asyncio.to_thread(cxlrpc.connect_sync, url, wait_for_ready=20))
    assert not await until(task.done, 0.3)
    async with make_server(url):
        client = await asyncio.wait_for(task, 20)
        with client:
            assert await asyncio.to_thread(client.call, "echo", b"ready", timeout=5) == b"ready"


async def test_wait_for_ready_has_a_limit_and_cancels_cleanly(url):
    """A number of seconds bounds the wait (Unavailable after it); True waits until cancelled,
    and the cancelled connect leaves nothing behind; a negative wait is refused."""
    t = time.monotonic()
    with pytest.raises(cxlrpc.Unavailable, match="no server"):
        await cxlrpc.connect(url, wait_for_ready=0.3)
    assert 0.3 <= time.monotonic() - t < 5
    with pytest.raises(cxlrpc.Unavailable, match="no server"):
        await asyncio.to_thread(cxlrpc.connect_sync, url, wait_for_ready=0.3)
    t = time.monotonic()
    with pytest.raises(cxlrpc.Unavailable):  # the default: at once
        await cxlrpc.connect(url)
    assert time.monotonic() - t < 0.3

    async def forever():
        return await cxlrpc.connect(url, wait_for_ready=True)

    task = asyncio.create_task(forever())
    assert not await until(task.done, 0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ValueError, match="wait_for_ready"):
        cxlrpc.connect(url, wait_for_ready=-1)


# ------------------------------------------------------------------ 3. reconnecting
async def _judged_gone(client) -> None:
    """Wait until the client's monitor (every 0.1 s) has seen its server go."""
    assert await until(lambda: client._conn.gone is not None, 5), "the client never saw its server go"


async def test_next_call_reconnects_to_a_restarted_server(url):
    """Server A closes with a call in flight (it fails with Unavailable), server B serves the
    same URL: the same client's next call reaches B, through a new mapping and slot."""
    a = make_server(url)
    await a.start()
    try:
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"a", timeout=5) == b"a"
            old = client._conn.chan.region.epoch
            in_flight = asyncio.create_task(client.call("slow", 30.0))
            assert await until(lambda: a.started == 1, 5)
            await a.close()
            with pytest.raises(cxlrpc.Unavailable):
                await asyncio.wait_for(in_flight, 5)
            await _judged_gone(client)
            with pytest.raises(cxlrpc.Unavailable, match="reconnecting failed: no server"):
                await client.call("echo", b"nobody", timeout=5)  # at once: no server to wait for
            async with make_server(url):
                assert await client.call("echo", b"b", timeout=5) == b"b"
                assert client._conn.chan.region.epoch != old
                assert await client.health(timeout=5) == "SERVING"
        with pytest.raises(cxlrpc.Unavailable, match="closed"):
            await client.call("echo", b"closed", timeout=5)  # a closed client never reconnects
    finally:
        await a.close()


async def test_concurrent_callers_share_one_reconnection(url, monkeypatch):
    attaches = []

    def counting_attach(*args):
        attaches.append(args)
        return attach(*args)

    attach = client_connection.attach
    monkeypatch.setattr(client_connection, "attach", counting_attach)
    async with make_server(url) as a, cxlrpc.connect(url) as client:
        await a.close()
        await _judged_gone(client)
        async with make_server(url):
            attaches.clear()
            replies = await asyncio.gather(*(client.call("echo", i, timeout=10) for i in range(8)))
            assert replies == list(range(8))
            assert len(attaches) == 1


async def test_reconnection_waits_for_ready_within_the_call_deadline(url):
    """With wait_for_ready the call after a restart waits for the new server; a call whose
    timeout ends first gets DeadlineExceeded, and its abandoned attempt leaves nothing behind."""
    async with make_server(url) as a, cxlrpc.connect(url, wait_for_ready=20) as client:
        threads = monitors()
        await a.close()
        await _judged_gone(client)
        with pytest.raises(cxlrpc.DeadlineExceeded, match="connecting"):
            await client.call("echo", b"late", timeout=0.3)
        assert await until(lambda: client._connecting is None, 5)
        assert monitors() == threads - 1  # the old connection's monitor ended; no new one runs
        call = asyncio.create_task(client.call("echo", b"waited", timeout=20))
        assert not await until(call.done, 0.3)
        async with make_server(url):
            assert await asyncio.wait_for(call, 20) == b"waited"


async def test_blocking_client_reconnects(url):
    async with make_server(url) as a:
        client = await asyncio.to_thread(cxlrpc.connect_sync, url)
        try:
            assert await asyncio.to_thread(client.call, "echo", b"a", timeout=5) == b"a"
            await a.close()
            await _judged_gone(client)
            with pytest.raises(cxlrpc.Unavailable, match="reconnecting failed"):
                await asyncio.to_thread(client.call, "echo", b"nobody", timeout=5)
            async with make_server(url):
                assert await asyncio.to_thread(client.call, "echo", b"b", timeout=5) == b"b"
        finally:
            client.close()


async def test_blocking_callers_share_a_failed_reconnection(url):
    """Threads queued behind a reconnection that waits 1 s for a server in vain get its error
    when it fails, instead of waiting 1 s more each."""
    async with make_server(url) as a:
        client = await asyncio.to_thread(cxlrpc.connect_sync, url, wait_for_ready=1.0)
        try:
            await a.close()
            await _judged_gone(client)

            def call() -> str:
                try:
                    client.call("echo", b"x", timeout=10)
                except cxlrpc.Unavailable as exc:
                    return exc.message
                return "served"

            t = time.monotonic()
            outcomes = await asyncio.gather(*(asyncio.to_thread(call) for _ in range(3)))
            elapsed = time.monotonic() - t
            assert all("reconnecting failed: no server" in o for o in outcomes), outcomes
            assert 1.0 <= elapsed < 2.5, f"the callers did not share the attempt ({elapsed:.2f} s)"
        finally:
            client.close()


async def test_killed_server_fails_calls_in_flight_and_its_successor_is_reached(name):
    """kill -9 of the server process: the call in flight fails with Unavailable (no hang),
    calls fail at once while only the dead server's region is there, and once a new server
    took the region over the same client's next call reaches it."""
    url = f"shm://{name}"
    with echo_server(url) as first:
        client = await cxlrpc.connect(url)
        try:
            assert await client.call("pid", timeout=5) == first.pid
            in_flight = asyncio.create_task(client.call("sleep", 30.0))
            assert await until(lambda: client._replies.pending, 5)  # the request is pushed
            os.kill(first.pid, signal.SIGKILL)
            await asyncio.to_thread(first.join, 10)
            with pytest.raises(cxlrpc.Unavailable):
                await asyncio.wait_for(in_flight, 5)
            with pytest.raises(cxlrpc.Unavailable, match="reconnecting failed"):
                await client.call("echo", b"dead", timeout=5)
            with echo_server(url) as second:
                assert await client.call("pid", timeout=5) == second.pid
                assert await client.call("echo", b"again", timeout=5) == b"again"
        finally:
            await client.close()


def test_no_warning_for_closed_clients(name):
    """Clients closed (or never opened) are collected without a warning."""
    url = f"shm://{name}"

    async def main() -> None:
        async with make_server(url):
            async with cxlrpc.connect(url) as client:
                await client.call("echo", 1, timeout=5)
            del client
            sync = await asyncio.to_thread(cxlrpc.connect_sync, url)
            sync.close()
            del sync
            cxlrpc.Client(url)  # never opened
            gc.collect()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(main())
    assert not [w for w in record if "cxlrpc client" in str(w.message)]


async def test_a_reconnection_to_a_server_whose_heartbeat_stopped_fails_at_once(name):
    """A server on another host that died leaves its region behind and never acknowledges:
    a client that judged its heartbeat stopped fails its reconnection at once (Unavailable)
    while the region shows that same epoch and heartbeat, and attaches once it moves."""
    from cxlrpc.client_connection import attach
    url = f"shm://{name}"
    async with cxlrpc.Server(url) as server:
        server._stop_beating()  # as if it died: its heartbeat stands still
        region = server._region
        stopped = (region.epoch, region.heartbeat_value())
        with pytest.raises(cxlrpc.Unavailable, match="heartbeat has not moved"):
            attach(url, 1e-3, stopped)
        region.beat()  # it moved: a server is there after all
        chan = attach(url, 1e-3, stopped)
        chan.detach()
        chan.region.close()
