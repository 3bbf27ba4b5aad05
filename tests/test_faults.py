"""Fault suite: peers killed with SIGKILL at chosen points, sustained load, a full request ring.

Every server and most clients run in their own (spawned) processes; the test process keeps
its own clients busy across each fault, checking every reply against its unique request.
Figures worth quoting are printed (run with ``-s`` to see them).
"""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time

import pytest

import cxlrpc
from cxlrpc.channel import read_geometry
from cxlrpc.memory import ACQUIRE
from cxlrpc.region import Region
from cxlrpc.ring.record import HEAD_OFFSET
from procs import (CTX, Pump, claim_and_die, client_holding_slot, connect_within, fault_server,
                   open_counting, report, rss_bytes, start_fault_server, start_load_clients, stop, until,
                   wait_for)

LOAD_SECONDS = float(os.environ.get("CXLRPC_LOAD_SECONDS", "20"))


# ----------------------------------------------------------------------------- killed clients
@pytest.mark.parametrize("in_handler", [False, True], ids=["idle", "in-handler"])
async def test_killed_client_is_reclaimed_and_others_lose_nothing(url, in_handler):
    """A client SIGKILLed while idle or while the server runs its slow call loses nobody else a reply, and its slot comes back within 5 s."""
    server = start_fault_server(url, slots=2)
    child = None
    clients = []
    try:
        before = await open_counting(url)
        clients.append(before)
        pump_before = Pump(before, "before").start()
        child = await asyncio.to_thread(client_holding_slot, url, in_handler)
        if in_handler:  # the dead client's handler must really be running
            assert await until(lambda: _active_is(before, 1), 5)
        assert await until(lambda: pump_before.ok >= 50, 10)
        os.kill(child.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        if in_handler:
            stop(child)  # reaped at once: the server's same-host PID check sees it gone
        # else: left a zombie, which the same-host PID check counts as dead too (reclamation by
        # heartbeat alone, for peers of another host identity, is in test_namespaces.py)
        after = await connect_within(url, 5.0)
        reclaim = time.monotonic() - t_kill
        assert after is not None, "the killed client's slot was not reclaimed within 5 s"
        clients.append(after)
        stop(child)
        pump_after = Pump(after, "after").start()
        if in_handler:  # its handler task was cancelled when the slot was reaped
            assert await until(lambda: _active_is(before, 0), 5)
        mark = pump_before.ok
        assert await until(lambda: pump_after.ok >= 200 and pump_before.ok >= mark + 200, 20)
        await pump_before.stop()
        await pump_after.stop()
        pump_before.check()
        pump_after.check()
        report(f"killed client ({'in handler' if in_handler else 'idle, a zombie'}; PID check)",
               reclaim_s=round(reclaim, 3), calls_checked=pump_before.ok + pump_after.ok)
    finally:
        for c in clients:
            await c.close()
        if child is not None:
            stop(child)
        stop(server)


@pytest.mark.parametrize("write_header", [True, False], ids=["header-written", "claim-only"])
async def test_client_killed_between_claim_and_commit_does_not_stall_the_ring(url, write_header):
    """A producer SIGKILLed between its MPSC claim and its commit blocks the request ring only until the server unblocks it; no live client loses a reply."""
    client_timeout = 0.5
    server = start_fault_server(url, slots=2, client_timeout=client_timeout)
    clients = []
    try:
        before = await open_counting(url)
        clients.append(before)
        pump_before = Pump(before, "before").start()
        assert await until(lambda: pump_before.ok >= 50, 10)
        t0 = time.monotonic()
        position = await asyncio.to_thread(claim_and_die, url, write_header)  # pump keeps calling
        t_dead = time.monotonic()
        mark = pump_before.ok
        # bounded: the server turns the dead record into padding once the slot is reaped
        assert await until(lambda: pump_before.ok >= mark + 100, 10), "request ring stayed blocked"
        t_flowing = time.monotonic()
        with Region.open(url) as region:  # the head is past the claim that was never committed
            assert region.mem.load(read_geometry(region).request_ring + HEAD_OFFSET, ACQUIRE) > position
        stall = pump_before.max_gap(t0, t_flowing)
        assert stall < client_timeout + 2.0
        after = await connect_within(url, 5.0)
        assert after is not None, "the dead producer's slot was not reclaimed within 5 s"
        clients.append(after)
        pump_after = Pump(after, "after").start()
        assert await until(lambda: pump_after.ok >= 200, 10)
        await pump_before.stop()
        await pump_after.stop()
        pump_before.check()
        pump_after.check()
        report(f"client killed between claim and commit ({'header written' if write_header else 'claim only'})",
               ring_stall_s=round(stall, 3), client_timeout=client_timeout,
               since_death_s=round(t_flowing - t_dead, 3))
    finally:
        for c in clients:
            await c.close()
        stop(server)


# ----------------------------------------------------------------------------- killed server
def _waiting_client_main(url: str, use_async: bool, ready, results) -> None:
    import cxlrpc

    def blocking() -> None:
        with cxlrpc.connect_sync(url) as client:
            client.call("echo", b"attached", timeout=10)
            ready.set()
            try:
                client.call("sleep", 30.0, timeout=60)
                results.put(("returned", time.monotonic()))
            except cxlrpc.RpcError as exc:
                results.put((type(exc).__name__, time.monotonic()))

    async def nonblocking() -> None:
        async with cxlrpc.connect(url) as client:
            await client.call("echo", b"attached", timeout=10)
            calls = [asyncio.ensure_future(client.call("sleep", 30.0, timeout=60)) for _ in range(2)]
            await asyncio.sleep(0)
            ready.set()
            for c in asyncio.as_completed(calls):
                try:
                    await c
                    results.put(("returned", time.monotonic()))
                except cxlrpc.RpcError as exc:
                    results.put((type(exc).__name__, time.monotonic()))

    if use_async:
        asyncio.run(nonblocking())
    else:
        blocking()


async def test_killed_server_fails_every_waiting_client_fast_and_restarts_cleanly(url):
    """After SIGKILL of the server every waiting call (async and blocking, in this and other processes) ends in Unavailable within 2 s, and a new server on the name serves new clients."""
    server = start_fault_server(url)
    children = []
    async_clients, sync_clients = [], []
    outcomes: list[tuple[str, float]] = []
    child_results = CTX.Queue()
    expected_child = 0
    try:
        for use_async in (True, False):
            ready = CTX.Event()
            p = CTX.Process(target=_waiting_client_main, args=(url, use_async, ready, child_results), daemon=True)
            p.start()
            children.append(p)
            expected_child += 2 if use_async else 1
            assert await asyncio.to_thread(ready.wait, 20), "waiting client child did not attach"
        for _ in range(3):
            async_clients.append(await cxlrpc.connect(url, server_timeout=1.0))
        for _ in range(2):
            sync_clients.append(cxlrpc.connect_sync(url, server_timeout=1.0))

        async def waiting_async(client) -> None:
            try:
                await client.call("sleep", 30.0, timeout=60)
                outcomes.append(("returned", time.monotonic()))
            except cxlrpc.RpcError as exc:
                outcomes.append((type(exc).__name__, time.monotonic()))

        def waiting_sync(client) -> None:
            try:
                client.call("sleep", 30.0, timeout=60)
                outcomes.append(("returned", time.monotonic()))
            except cxlrpc.RpcError as exc:
                outcomes.append((type(exc).__name__, time.monotonic()))

        waits = [asyncio.ensure_future(waiting_async(c)) for c in async_clients for _ in range(2)]
        threads = [threading.Thread(target=waiting_sync, args=(c,), daemon=True) for c in sync_clients]
        for t in threads:
            t.start()
        n_waiting = len(waits) + len(threads) + expected_child
        probe = await cxlrpc.connect(url)
        try:  # every call is inside its handler before the kill
            assert await until(lambda: _active_is(probe, n_waiting), 10)
        finally:
            await probe.close()
        os.kill(server.pid, signal.SIGKILL)  # left a zombie: clients must rely on the heartbeat
        t_kill = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*waits), 5)
        for t in threads:
            await asyncio.to_thread(t.join, 5)
            assert not t.is_alive(), "a blocking call hung after the server died"
        for _ in range(expected_child):
            outcomes.append(await asyncio.to_thread(child_results.get, True, 5))
        assert len(outcomes) == n_waiting
        assert {kind for kind, _ in outcomes} == {"Unavailable"}, outcomes
        detect = [t - t_kill for _, t in outcomes]
        assert max(detect) < 2.0, f"slowest waiting call saw the dead server after {max(detect):.2f} s"
        with pytest.raises(cxlrpc.Unavailable):  # and later calls on old connections fail at once
            await async_clients[0].call("echo", b"x", timeout=5)
        report("killed server (heartbeat path, server_timeout=1.0)", waiting_calls=len(outcomes),
               detect_min_s=round(min(detect), 3), detect_max_s=round(max(detect), 3))
    finally:
        for c in async_clients:
            await c.close()
        for c in sync_clients:
            c.close()
        for p in children:
            stop(p)
        stop(server)
        child_results.close()
    # the dead server's segment is still there; a new server replaces it and serves new clients
    with fault_server(url):
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"again", timeout=10) == b"again"
        with cxlrpc.connect_sync(url) as client:
            assert client.call("echo", b"sync again", timeout=10) == b"sync again"


async def _active_is(client, n: int) -> bool:
    return await client.call("active", timeout=5) == n


# ----------------------------------------------------------------------------- load
@pytest.mark.timeout(LOAD_SECONDS + 120)
def test_load_four_processes_nothing_lost_duplicated_or_mismatched_memory_flat(url):
    """4 client processes x 32 calls in flight for CXLRPC_LOAD_SECONDS: every reply matches its request exactly once, and server RSS stays flat."""
    n_procs, inflight = 4, 32
    with fault_server(url, slots=8) as server:
        procs, progress, results = start_load_clients(url, n_procs, LOAD_SECONDS, inflight=inflight,
                                                      max_len=512, call_timeout=30.0)
        try:
            assert wait_for(lambda: progress.value >= 2000, 30, interval=0.05), "load never warmed up"
            rss_warm = rss_bytes(server.pid)
            t_warm = time.monotonic()
            stats = []
            deadline = time.monotonic() + LOAD_SECONDS + 60
            while len(stats) < n_procs and time.monotonic() < deadline:
                try:
                    stats.append(results.get(timeout=1))
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        try:
                            stats.append(results.get(timeout=1))
                        except queue.Empty:
                            break
            rss_end = rss_bytes(server.pid)
            assert server.is_alive()
        finally:
            for p in procs:
                stop(p)
            results.close()
    crashed = [s for s in stats if "crash" in s]
    assert not crashed, crashed
    assert len(stats) == n_procs, f"only {len(stats)} of {n_procs} load clients reported"
    sent = sum(s["sent"] for s in stats)
    ok = sum(s["ok"] for s in stats)
    mismatched = sum(s["mismatched"] for s in stats)
    duplicates = sum(s["duplicates"] for s in stats)
    foreign = sum(s["foreign"] for s in stats)
    errors = [s["errors"] for s in stats if s["errors"]]
    late = sum(s["late"] for s in stats)
    report("load", processes=n_procs, inflight_each=inflight, seconds=LOAD_SECONDS, calls_checked=ok,
           calls_per_s=round(ok / LOAD_SECONDS), lost=sent - ok, duplicated=duplicates,
           mismatched=mismatched, max_latency_s=round(max(s["max_latency"] for s in stats), 3),
           rss_warm_mib=round(rss_warm / 2**20, 1), rss_end_mib=round(rss_end / 2**20, 1),
           measured_over_s=round(time.monotonic() - t_warm, 1))
    assert not errors, errors
    assert mismatched == 0 and duplicates == 0 and foreign == 0
    assert sent == ok, f"{sent - ok} calls lost"
    assert late == 0
    assert sum(s["replies"] for s in stats) == ok  # exactly one reply frame per call
    assert rss_end - rss_warm < 50 * 2**20, f"server RSS grew {(rss_end - rss_warm) / 2**20:.1f} MiB under load"


# ----------------------------------------------------------------------------- ring full
async def test_calls_that_met_a_full_ring_wake_a_resting_reader(url):
    """The reader task rests while a caller polls the reply ring itself, and that caller wakes
    it at its end only if calls remain. Two calls that then meet a full request ring are both
    in flight once they go out, so neither polls for its reply: they wake the reader, and are
    answered (they used to wait, replies in the ring, until their deadline)."""
    with fault_server(url, slots=2, request_capacity=4096, response_capacity=4096):
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"warm", timeout=10) == b"warm"
            client.send_nowait("slow_echo", [0.5, b""])  # holds the server's reader for 0.5 s
            while True:  # then the request ring fills, to the last byte a call would take
                try:
                    client.send_nowait("echo", b"")
                except cxlrpc.ResourceExhausted:
                    break
            client._replies.direct = True  # a caller polls directly: the reader rests when it looks
            deadline = time.monotonic() + 5
            while client._replies.reader_wake is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert client._replies.reader_wake is not None
            client._replies.direct = False  # that caller ended with nothing in flight: no wake-up
            replies = await asyncio.gather(*(client.call("echo", b"%d" % i, timeout=5) for i in range(2)))
            assert replies == [b"0", b"1"]


async def test_full_small_rings_are_backpressure_not_loss_or_deadlock(url):
    """With 4 KiB rings and a blocking slow handler, 200 calls from 2 clients all complete correctly after waiting on full rings."""
    with fault_server(url, slots=2, request_capacity=4096, response_capacity=4096):
        a, b = await open_counting(url), await open_counting(url)
        refused = [0]
        try:
            for client in (a, b):  # count how often a push met a full request ring
                ring = client._conn.chan.requests
                real = ring.try_push_parts

                def counting_push(parts, *args, real=real):
                    ok = real(parts, *args)
                    if not ok:
                        refused[0] += 1
                    return ok

                ring.try_push_parts = counting_push
            payloads = [(c, i, bytes([i]) * (300 + 7 * i)) for i in range(100) for c in (0, 1)]
            t0 = time.monotonic()
            replies = await asyncio.wait_for(asyncio.gather(*(
                (a if c == 0 else b).call("slow_echo", [0.002, p], timeout=30) for c, i, p in payloads)), 45)
            elapsed = time.monotonic() - t0
            assert replies == [p for _, _, p in payloads]
            assert a.duplicates() == b.duplicates() == 0
            assert refused[0] > 0, "the request ring never filled: the test did not exercise backpressure"
            report("full rings", calls=len(payloads), full_ring_retries=refused[0], seconds=round(elapsed, 2))
        finally:
            await a.close()
            await b.close()
