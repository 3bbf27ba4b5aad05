"""Fencing (cxlrpc.fencing): a departed client's resources are freed only once it can no longer
write into the region; ``Server.on_fenced`` says when."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import cxlrpc
import cxlrpc.channel as channel
from cxlrpc.channel import DEAD, DETACHED, KIND_RPC, REAPED, Departure, client_channel, layout, server_channel
from cxlrpc.fencing import Fences
from cxlrpc.memory import RELEASE
from cxlrpc.region import PidWatch, Region
from procs import client_holding_slot, stop, until


def test_fence_timeout_must_be_positive() -> None:
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="fence_timeout"):
            cxlrpc.Server("shm://unused", fence_timeout=bad)


def test_a_holder_on_another_host_is_fenced_after_the_timeout() -> None:
    fences = Fences(5.0)
    assert fences.depart(Departure(1, 7, DETACHED), 100.0)
    assert fences.depart(Departure(2, 7, DEAD), 100.0)
    assert not fences.depart(Departure(3, 9, REAPED), 100.0)  # other host: no PID to watch
    assert len(fences) == 1
    assert fences.due(104.9) == []
    assert fences.due(105.0) == [(3, 9)]
    assert fences.due(200.0) == []  # once
    assert len(fences) == 0


def test_a_frozen_holder_of_this_host_is_fenced_when_it_exits() -> None:
    """Its PidWatch (opened while it held the slot) proves its exit; no timeout fences it."""
    proc = os.fork()
    if proc == 0:
        signal.pause()
        os._exit(0)
    try:
        watch = PidWatch()
        assert not watch.dead(proc)
        assert watch.pinned(proc)
        fences = Fences(0.01)
        assert not fences.depart(Departure(0, 3, REAPED, proc, True, watch), time.monotonic())
        assert fences.due(time.monotonic() + 3600) == []  # alive: the timeout is not for it
        os.kill(proc, signal.SIGKILL)
        os.waitpid(proc, 0)
        assert fences.due(time.monotonic()) == [(0, 3)]
    finally:
        try:
            os.kill(proc, signal.SIGKILL)
            os.waitpid(proc, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


async def test_on_fenced_follows_on_disconnect_for_a_detaching_client(url: str) -> None:
    server = cxlrpc.Server(url)
    events: list[tuple[str, cxlrpc.Peer]] = []
    server.on_disconnect(lambda peer: events.append(("disconnect", peer)))
    server.on_fenced(lambda peer: events.append(("fenced", peer)))
    server.on_fenced(lambda peer: 1 / 0)  # logged, never breaks the server

    @server.method("echo")
    def echo(x: bytes) -> bytes:
        return x

    async with server:
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"x") == b"x"
        assert await until(lambda: len(events) == 2, 10), events
        assert [e[0] for e in events] == ["disconnect", "fenced"]
        assert events[0][1] == events[1][1]
        async with cxlrpc.connect(url) as client:  # still serving
            assert await client.call("echo", b"y") == b"y"


async def test_a_frozen_client_is_quarantined_until_it_dies(url: str) -> None:
    """SIGSTOP: reaped after client_timeout (on_disconnect), but not fenced while its process
    lives, however long past fence_timeout; SIGKILL fences it."""
    server = cxlrpc.Server(url, client_timeout=0.3, fence_timeout=0.2)
    left: list[cxlrpc.Peer] = []
    fenced: list[cxlrpc.Peer] = []
    server.on_disconnect(left.append)
    server.on_fenced(fenced.append)

    @server.method("echo")
    def echo(x: bytes) -> bytes:
        return x

    @server.method("sleep")
    async def sleep(s: float) -> float:
        await asyncio.sleep(s)
        return s

    async with server:
        proc = await asyncio.to_thread(client_holding_slot, url)
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            assert await until(lambda: left, 10), "the frozen client was never reaped"
            await asyncio.sleep(1.0)  # the condition under test is that nothing happens
            assert fenced == [], "a live (frozen) client was fenced"
            os.kill(proc.pid, signal.SIGKILL)
            assert await until(lambda: fenced, 10), "the killed client was never fenced"
            assert fenced == left
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)  # (a stopped process ignores SIGTERM)
            await asyncio.to_thread(stop, proc)


def test_a_stray_write_freeing_a_live_slot_does_not_fence_its_holder(url):
    """One word (the slot's state, or its PID) written over must not pass a live holder off as
    detached or dead, which would free at once what it is still writing: it departs as REAPED
    and stays quarantined (until its process exits: this one's never does here), even once it
    noticed and released (a slot taken from it is not its to speak for)."""
    geo = layout(2, 1024, 1024, "hardware")
    region = Region.create(url, geo.size, KIND_RPC)
    server = server_channel(region, geo)
    region.publish()
    client = None
    try:
        client = client_channel(Region.open(url))
        assert server.reap(1.0, time.monotonic()) == []  # seen, pinned
        base = geo.slot(client.slot)
        region.mem.store(base + channel._SLOT_PID, 4_000_000, RELEASE)  # the PID word: no such process
        assert server.reap(1.0, time.monotonic()) == []  # the PID seen at attach is alive
        region.mem.store(base, client.gen << 1, RELEASE)  # the state word: claimed bit cleared
        (gone,) = server.reap(1.0, time.monotonic())
        assert (gone.slot, gone.gen, gone.how, gone.pid) == (client.slot, client.gen, REAPED, os.getpid())
        fences = Fences(3600.0)
        assert not fences.depart(gone, time.monotonic())
        client.release()
        assert fences.due(time.monotonic()) == []  # this process lives: still quarantined
        fences.close()
        # a holder that releases its slot itself departs DETACHED (fenced at once)
        again = client_channel(client.region)
        server.reap(1.0, time.monotonic())
        again.release()
        (left,) = server.reap(1.0, time.monotonic())
        assert (left.gen, left.how) == (again.gen, DETACHED)
    finally:
        if client is not None:
            client.region.close()
        server.close()
        region.close()
        region.unlink()
