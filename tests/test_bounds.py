"""Per-connection bounds (issue 40, items 4-6): a client that stops reading its replies, one
that floods ALLOCs, one that drip-feeds followed requests. Each is a child process against a
server in another; the server's memory stays bounded, the flooder gets RESOURCE_EXHAUSTED,
and a bystander's echo p50 stays within 2x of an idle server's (the same options, measured
alternately in the same run: median of the per-round ratios)."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

import cxlrpc
from cxlrpc import frame as fr
from cxlrpc.heap import GRANT
from bounds_peers import (_alloc_flooder_main, _drip_feeder_main, _non_reader_main, bounded_server, hostile,
                          p50_ratios, rss_bytes)

MiB = 1 << 20
#: A bystander's echo p50 against the flooded server over the idle one's: at most this
#: (the median of the rounds' ratios; two noisy cores run both servers and the flooder).
LATENCY_RATIO = 2.0
#: Both servers: small rings and heap, so that two fit and the floods fill them fast.
OPTS = dict(slots=4, response_capacity=1 * MiB, max_message_size=8 * MiB)


def _under_load(idle, busy, loaded, seconds: float = 2.5, rounds: int = 12) -> list[float]:
    """The bystander's p50 ratios, measured once the flood shows (``loaded(stats)``), in
    ``rounds`` spread over ``seconds`` of it."""
    end = time.monotonic() + 10
    while not loaded(busy.call("stats", timeout=10)):
        assert time.monotonic() < end, "the flood did not reach the server"
        time.sleep(0.01)
    return p50_ratios(idle, busy, rounds, between=lambda: time.sleep(seconds / rounds))


def _pair(name: str, **opts):
    """An idle and a busy server with the same options, and a blocking client of each."""
    a, b = f"shm://{name}a", f"shm://{name}b"
    return a, b, bounded_server(a, **OPTS, **opts), bounded_server(b, **OPTS, **opts)


def test_a_client_that_stops_reading_replies_is_refused_not_queued(name):
    """Item 4: replies held for a non-reader are bounded; its calls get RESOURCE_EXHAUSTED."""
    a, b, idle_server, busy_server = _pair(name)
    with idle_server, busy_server as proc, cxlrpc.connect_sync(a) as idle, cxlrpc.connect_sync(b) as busy:
        p50_ratios(idle, busy, 2)  # warm-up
        before = rss_bytes(proc.pid)
        with hostile(_non_reader_main, b, 16 << 10) as flooder:
            ratios = _under_load(idle, busy, lambda st: st["backlog_replies"] > 0)
            stats = busy.call("stats", timeout=10)
            grown = rss_bytes(proc.pid) - before
            got = flooder.result()
        assert got["exhausted"] > 0 and got["other"] == 0, (got, stats)
        assert grown < 64 * MiB, (grown, stats, got)
        assert statistics.median(ratios) <= LATENCY_RATIO, ratios
        limits = cxlrpc.Server(b, **OPTS).limits
        # what is held for the non-reader: its limits, and refusals of as many entries again
        refusals = 2 * limits.max_backlog_replies * 512
        assert stats["backlog_bytes"] <= limits.max_backlog_bytes + (16 << 10) + refusals, stats
        assert stats["backlog_replies"] <= 2 * limits.max_backlog_replies, stats
        assert busy.call("echo", b"after", timeout=10) == b"after"


def test_alloc_floods_are_bounded_per_connection(name):
    """Item 5: ALLOCs waiting for the heap are bounded per connection; the rest are refused."""
    a, b, idle_server, busy_server = _pair(name)
    with idle_server, busy_server as proc, cxlrpc.connect_sync(a) as idle, cxlrpc.connect_sync(b) as busy:
        p50_ratios(idle, busy, 2)
        before = rss_bytes(proc.pid)
        with hostile(_alloc_flooder_main, b, 8 * MiB) as flooder:  # the whole heap, each
            ratios = _under_load(idle, busy, lambda st: st["alloc_waiters"] > 0)
            stats = busy.call("stats", timeout=10)
            grown = rss_bytes(proc.pid) - before
            got = flooder.result()
        assert got["exhausted"] > 0, (got, stats)
        assert grown < 32 * MiB, (grown, stats)
        assert statistics.median(ratios) <= LATENCY_RATIO, ratios
        limits = cxlrpc.Server(b, **OPTS).limits
        assert 0 < stats["alloc_waiters"] <= limits.max_alloc_waiters, stats
        assert got["exhausted"] >= got["sent"] - limits.max_alloc_waiters - 1 > 0, got


async def test_an_alloc_without_a_deadline_gets_one(name):
    """Item 5: an ALLOC with no deadline waits alloc_timeout at most (RESOURCE_EXHAUSTED)."""
    url = f"shm://{name}"
    async with cxlrpc.Server(url, max_message_size=4 * MiB, alloc_timeout=0.3) as server, \
            cxlrpc.connect(url) as client:
        chan, loop = client._conn.chan, asyncio.get_running_loop()
        answers = []
        for call_id in (7001, 7002):  # the first takes the heap (never used), the second waits
            fut = loop.create_future()
            client._replies.pending[call_id] = (fut, None)
            answers.append(fut)
            head = fr.header(fr.ALLOC, fr.RAW, 0, chan.slot, chan.gen, call_id, 0.0, b"")
            assert chan.push((head, GRANT.pack(4 * MiB, 0)))
            chan.server_bell.ring()
        try:
            await asyncio.wait_for(answers[0], 10)
            t0 = time.monotonic()
            with pytest.raises(cxlrpc.ResourceExhausted, match="alloc_timeout"):
                await asyncio.wait_for(answers[1], 10)
            assert 0.2 < time.monotonic() - t0 < 5
            assert not server._bodies.heap_waiting
        finally:
            client._replies.pending.pop(7001, None)
            client._replies.pending.pop(7002, None)


def test_drip_fed_followed_requests_are_bounded_and_cheap(name):
    """Item 6: followed requests kept alive by a progress bump now and then are capped per
    connection (the rest refused) and cost the loop little while idle; the refused ones'
    extents stay the writer's while it may write them, and are freed once it is gone."""
    a, b, idle_server, busy_server = _pair(name)
    with idle_server, busy_server, cxlrpc.connect_sync(a) as idle, cxlrpc.connect_sync(b) as busy:
        p50_ratios(idle, busy, 2)
        before = busy.call("stats", timeout=10)["heap_used"]
        with hostile(_drip_feeder_main, b, 200, 8192) as feeder:
            ratios = _under_load(idle, busy, lambda st: st["following"] > 0)
            stats = busy.call("stats", timeout=10)
            got = feeder.result()
        end = time.monotonic() + 15  # the feeder is gone: what it held is freed (fenced)
        later = busy.call("stats", timeout=10)
        while later["heap_used"] > before and time.monotonic() < end:
            time.sleep(0.05)
            later = busy.call("stats", timeout=10)
        assert got["exhausted"] > 0, (got, stats)
        assert statistics.median(ratios) <= LATENCY_RATIO, (ratios, stats)
        limits = cxlrpc.Server(b, **OPTS).limits
        assert 0 < stats["following"] <= limits.max_followed_requests, stats
        assert got["exhausted"] >= 200 - limits.max_followed_requests, got
        assert later["heap_used"] == before, (before, later)


@pytest.mark.parametrize("option, value", [
    ("max_backlog_bytes", 0), ("max_backlog_replies", -1), ("max_alloc_waiters", 1.5),
    ("alloc_timeout", 0), ("alloc_timeout", float("inf")), ("max_followed_requests", True)])
def test_limits_are_validated(option, value):
    with pytest.raises(ValueError, match=option):
        cxlrpc.Server("shm://unused", **{option: value})
