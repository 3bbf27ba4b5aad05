"""Issue 42: a dead writer's dirty lines, and a publishing store that overtakes its data, on
memory without coherence (``sim://``, with the simulator's harsher modes on).

A killed process's dirty lines stay in its host's caches and land whenever evicted: with the
simulator's ``LIMBO`` they are kept, and land when a process of the same simulated host writes
back or invalidates them (as clwb/clflushopt reach the whole host's caches) or after a delay.
A writer killed with dirty lines in its request ring, in a heap extent or in a kv pool block:
the server, learning of its death on its own host, writes those ranges back before it hands
them to another; without that (the ``unfixed`` runs) the next holder's bytes are overwritten.

With ``TARGETED``, a write-back first lands the process's other dirty lines: an SPSC push that
stores its tail before writing its records back (a mutation of the Python reference) shows the
consumer a tail over records memory does not hold yet, and the correct push stays exact.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import sys
from pathlib import Path

import pytest

import cxlrpc
import cxlrpc.channel
import cxlrpc.simulator as simulator
from cxlrpc.channel import FlushServerChannel
from cxlrpc.heap import ServerHeap
from cxlrpc.janitor import Janitor
from cxlrpc.memory import ACQUIRE, RELEASE
from cxlrpc.region import Region, parse_url
from cxlrpc.ring import SpscRing
from cxlrpc.ring.record import HEADER_SIZE
from kvservice import KVClient, KVServer
from nc_ring_peer import intact, record, ring_offsets
from procs import run_python, until, wait_for

pytestmark = pytest.mark.timeout(120)
PEER = str(Path(__file__).with_name("dead_writer_peer.py"))
MiB = 1 << 20
DEAD_HOST, OTHER_HOST = "h", "n"  # the dead writer's host (the server's too), another host's
LIMBO_S = 120.0  # longer than a test: its dead writer's lines land only through its host


@pytest.fixture
def limbo(monkeypatch):
    """The simulator keeps gone processes' dirty lines (this process's caches on DEAD_HOST,
    no random evictions); the environment a dead writer needs."""
    monkeypatch.setattr(simulator, "LIMBO", LIMBO_S)
    monkeypatch.setattr(simulator, "HOST", DEAD_HOST)
    monkeypatch.setattr(simulator, "EVICTION_RATE", 0.0)
    return {**os.environ, "CXLRPC_SIM_LIMBO": str(LIMBO_S), "CXLRPC_SIM_HOST": DEAD_HOST,
            "CXLRPC_NO_NATIVE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}


async def _killed_writer(env: dict[str, str], role: str, url: str, size: int) -> int:
    """Start a dead_writer_peer, wait until it stopped at its payload's write-back, SIGKILL it;
    its PID."""
    proc = await asyncio.create_subprocess_exec(sys.executable, PEER, role, url, str(size), env=env,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.strip() == b"ready", (line, await proc.stderr.read())
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
    return proc.pid


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


async def _outcome(url: str, size: int) -> str:
    """A client of OTHER_HOST calls with fresh SIZE-byte payloads: "ok" when every reply is
    right, else what went wrong."""
    simulator.HOST = OTHER_HOST
    try:
        async with cxlrpc.connect(url) as client:
            simulator.HOST = DEAD_HOST
            rng = random.Random(size)
            for _ in range(3):
                payload = rng.randbytes(size)
                try:
                    reply = await client.call("digest", payload, timeout=3)
                except cxlrpc.RpcError as exc:
                    return f"{type(exc).__name__}: {exc}"
                if reply != _digest(payload):
                    return "a wrong reply (the server read other bytes than the client wrote)"
        return "ok"
    finally:
        simulator.HOST = DEAD_HOST


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "unfixed"])
@pytest.mark.parametrize("where,size", [("ring", 6000), ("heap", 64 << 10)])
async def test_a_killed_writers_dirty_lines_never_land_over_the_next_holders(name, limbo, monkeypatch,
                                                                          where, size, fixed):
    """A client killed between copying a request into its ring (or its heap extent) and
    writing it back; the server sees it dead (its PID, on this host), frees its slot and
    extent, and a client of another host gets them next (one slot, an empty heap: the same
    ring and extent). The server's write-back of the dead holder's ranges lands its lines
    before that; without it, the server's own invalidate of the new client's bytes lands the
    dead writer's over them (clflushopt writes back what its host holds dirty)."""
    if not fixed:
        if where == "ring":  # the request ring's range left out (the others are the slot's lines)
            ranges = FlushServerChannel.holder_ranges
            monkeypatch.setattr(FlushServerChannel, "holder_ranges", lambda self, slot: [
                r for r in ranges(self, slot) if r[0] != self.geo.client_request_ring(slot)])
        else:
            monkeypatch.setattr(ServerHeap, "_write_back", lambda self, offset: None)
    url = f"sim://{name}"
    server = cxlrpc.Server(url, slots=1, request_capacity=16 << 10, response_capacity=16 << 10,
                           max_message_size=1 * MiB, heap_size=1 * MiB, client_timeout=5.0)
    server.add_method("digest", _digest)
    fenced: list[cxlrpc.Peer] = []
    server.on_fenced(fenced.append)
    async with server:
        await _killed_writer(limbo, where, url, size)
        assert await until(lambda: fenced, 10, 0.02), "the dead writer was not seen gone"
        outcome = await _outcome(url, size)
    if fixed:
        assert outcome == "ok"
    else:  # the simulator shows the hole the fix closes
        assert outcome != "ok"  # (DeadlineExceeded: its request lost; a wrong reply: its body)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "unfixed"])
async def test_a_killed_kv_writers_dirty_lines_never_land_over_the_blocks_next_value(name, limbo,
                                                                                   monkeypatch, fixed):
    """A kv client killed after copying a put's value into its reserved block, before writing
    it back; the server fences it (dead on its host) and frees the block; a writer of another
    host puts ``victim`` into it, and a reader on the dead writer's host reads it: its
    invalidate would land the dead writer's lines first, had the server not written the block
    back before freeing it (and the version check cannot tell)."""
    if not fixed:
        monkeypatch.setattr(KVServer, "_reclaim", lambda self, offset, nbytes: None)
    url = f"sim://{name}"
    size = 64 << 10
    victim = hashlib.blake2b(b"victim", digest_size=64).digest() * (size // 64)
    async with KVServer(url, pool_size=4 * MiB, client_timeout=5.0, max_message_size=1 * MiB) as server:
        await _killed_writer(limbo, "kv", url, size)
        assert await until(lambda: server.stats()["pending_puts"] == 0
                           and server.stats()["quarantined_blocks"] == 0, 10, 0.02)
        simulator.HOST = OTHER_HOST
        try:
            x = await KVClient.connect(url)
        finally:
            simulator.HOST = DEAD_HOST
        async with x, KVClient.connect(url) as reader:
            await x.put("victim", victim)
            got = await reader.get_bytes("victim")
            again = await x.get_bytes("victim")
    if fixed:
        assert got == victim and again == victim
    else:
        assert got != victim and set(got) == {0xEE}  # the dead writer's bytes


@pytest.mark.parametrize("janitor", [True, False], ids=["janitor", "no-janitor"])
async def test_a_janitor_writes_back_a_dead_writer_of_its_host_before_the_server_reuses(
        name, limbo, monkeypatch, janitor):
    """The dead writer on another host than the server (its identity differs here): the
    server cannot reach its lines, reaps it (client_timeout) and frees its block once it is
    fenced (fence_timeout). A janitor on the writer's host (``python -m cxlrpc janitor``; here
    in-process, on the writer's simulated host) writes its ranges back as soon as its PID is
    gone, long before that; without one its lines land later (here LIMBO's 3 s), over the
    block's next value."""
    monkeypatch.setattr(simulator, "LIMBO", 3.0)
    monkeypatch.setattr(cxlrpc.channel, "host_identity", lambda: 0x5E12)  # the server's host
    env = {**limbo, "CXLRPC_SIM_LIMBO": "3.0"}
    url, size = f"sim://{name}", 64 << 10
    victim = hashlib.blake2b(b"victim", digest_size=64).digest() * (size // 64)
    simulator.HOST = "s"
    async with KVServer(url, pool_size=4 * MiB, client_timeout=0.5, fence_timeout=0.5,
                        max_message_size=1 * MiB) as server:
        simulator.HOST = DEAD_HOST
        jan = Janitor(url, also=[server.pool_url]) if janitor else None
        try:
            sweep = _sweep(jan)
            pid = await _killed_writer(env, "kv", url, size)
            assert await until(lambda: server.stats()["pending_puts"] == 0
                               and server.stats()["quarantined_blocks"] == 0, 20, 0.02)
            simulator.HOST = OTHER_HOST
            async with KVClient.connect(url) as x, KVClient.connect(url) as reader:
                await x.put("victim", victim)
                mark, path = f"~c.{DEAD_HOST}.{pid}.", parse_url(server.pool_url)[1]

                def landed() -> bool:  # its cache file goes once its lines landed
                    reader.pool.region.mem.invalidate(0, 64)  # (a call: what is due lands)
                    return not any(mark in f for f in simulator.side_files(path))

                assert await until(landed, 20, 0.05)
                got = await reader.get_bytes("victim")
        finally:
            simulator.HOST = DEAD_HOST
            if jan is not None:
                sweep.cancel()
                await asyncio.gather(sweep, return_exceptions=True)
                jan.close()
    if janitor:
        assert jan is not None and jan.written_back and got == victim
    else:
        assert got != victim and set(got) == {0xEE}


async def test_the_janitor_command_watches_a_flush_region_and_refuses_a_coherent_one(name):
    """``python -m cxlrpc janitor URL`` runs until SIGTERM (exit 0) on a flush-mode server's
    region, and refuses one on coherent memory (exit 1, the reason on stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    async with cxlrpc.Server(f"shm://{name}-hw", slots=2):
        status, _, err = await run_python(["-m", "cxlrpc", "janitor", f"shm://{name}-hw"], 60, env)
        assert status == 1 and "coherent memory" in err
    async with cxlrpc.Server(f"sim://{name}", slots=2, max_message_size=1 * MiB):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "cxlrpc", "janitor",
                                                    f"sim://{name}", env=env,
                                                    stdout=asyncio.subprocess.PIPE)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line.startswith(b"janitor: watching")
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def _sweep(jan: Janitor | None) -> asyncio.Task[None]:
    """The janitor's looks, every 20 ms, in this loop (none without one)."""
    async def sweep() -> None:
        while jan is not None:
            jan.look()
            await asyncio.sleep(0.02)
    return asyncio.get_running_loop().create_task(sweep())


# ---------------------------------------------------------------- the publishing store


def _early_tail_push(ring: SpscRing, data: bytes) -> bool:
    """The SPSC push with an ordering mutation (issue 42): the tail stored before the records'
    write-back, so an eviction may publish it before the records reach memory."""
    tail = ring._tail_local
    new_tail = ring._reserve(tail, len(data))
    if new_tail < 0:
        return False
    start = ring.data + ((new_tail - HEADER_SIZE - ((len(data) + 7) & ~7)) & ring.mask) + HEADER_SIZE
    ring.buf[start:start + len(data)] = data
    ring._tail_local = new_tail
    ring._tail.store(new_tail, RELEASE)  # (the mutation: before the write-back below)
    ring._span(ring.mem.writeback, tail, new_tail)
    ring.mem.writeback(ring._tail_at, 8)
    return True


@pytest.mark.parametrize("targeted", [-1, 0], ids=["targeted", "gentle"])
@pytest.mark.parametrize("mutated", [False, True], ids=["correct", "tail-first"])
def test_a_tail_stored_before_its_records_write_back_is_seen_early(name, monkeypatch, targeted, mutated):
    """Two caches of one process (a producer's and a consumer's mapping): with TARGETED, a
    write-back first lands the producer's other dirty lines, and the consumer polls in that
    moment (TARGETED_HOOK). The mutated push then shows it a tail over records memory does not
    hold (it drops or garbles them); the correct push stays exact; without TARGETED the
    simulator cannot tell the two apart (why the mode exists)."""
    monkeypatch.setattr(simulator, "EVICTION_RATE", 0.0)
    monkeypatch.setattr(simulator, "TARGETED", targeted)
    capacity, count = 4096, 200
    off = ring_offsets(capacity)[0]
    url = f"sim://{name}"
    owner = Region.create(url, off + 2 * capacity, kind=9)
    try:
        SpscRing(owner.buf, owner.mem, off, capacity).reset()
        owner.publish()
        with Region.open(url) as producer_region, Region.open(url) as consumer_region:
            producer = SpscRing(producer_region.buf, producer_region.mem, off, capacity)
            producer.attach()
            consumer = SpscRing(consumer_region.buf, consumer_region.mem, off, capacity)
            got: list[bytes] = []
            polling = []

            def poll_between(sim: simulator.CacheSim) -> None:  # in the producer's write-back
                if sim is producer_region._sim and not polling:
                    polling.append(1)
                    got.extend(consumer.pop_batch())
                    polling.clear()

            monkeypatch.setattr(simulator, "TARGETED_HOOK", poll_between)
            rng = random.Random(7)
            for i in range(count):
                data = record(i, rng)
                assert (_early_tail_push(producer, data) if mutated else producer.try_push(data))
                got.extend(consumer.pop_batch())
            exact = len(got) == count and all(intact(v, i) for i, v in enumerate(got))
    finally:
        owner.unlink()
        owner.close()
    assert exact == (not (mutated and targeted))


# ---------------------------------------------------------------- the simulator's modes


def test_limbo_lands_a_killed_or_closed_processes_lines_through_its_host_or_late(name, monkeypatch):
    """LIMBO: a killed process's dirty lines (and those of a mapping closed without writing
    them back) land once: at a write-back or invalidate of their range by a process of their
    host (not of another), and all of them at anyone's call after the delay; the files go
    with the region."""
    monkeypatch.setattr(simulator, "LIMBO", 0.3)
    monkeypatch.setattr(simulator, "EVICTION_RATE", 0.0)
    monkeypatch.setattr(simulator, "HOST", "a")
    url = f"sim://{name}"
    path = f"/cxlrpc.sim.{name}"
    mine = Region.create(url, 1 << 16, kind=9)
    try:
        mine.publish()
        monkeypatch.setattr(simulator, "HOST", "b")
        other = Region.open(url)
        monkeypatch.setattr(simulator, "HOST", "a")
        closed = Region.open(url)
        closed.mem.store(24576, 5, RELEASE)  # never written back: kept at close
        closed.close()
        code = ("import os, sys, time\nfrom cxlrpc.region import Region\nfrom cxlrpc.memory import RELEASE\n"
                "r = Region.open(sys.argv[1])\nr.mem.store(8192, 7, RELEASE)\nr.mem.store(16384, 9, RELEASE)\n"
                "print('ready', flush=True)\ntime.sleep(60)\n")
        env = {**os.environ, "CXLRPC_SIM_LIMBO": "0.3", "CXLRPC_SIM_HOST": "a",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, env=env)
        try:
            assert child.stdout.readline().strip() == b"ready"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()

        def seen(region: Region, at: int) -> int:
            region.mem.invalidate(at, 8)
            return region.mem.load(at, ACQUIRE)

        assert seen(other, 8192) == 0  # another host's invalidate reaches not its lines
        assert seen(mine, 8192) == 7   # its host's does
        mine.mem.store(8192, 8, RELEASE)
        mine.mem.writeback(8192, 8)
        assert seen(other, 8192) == 8  # landed once: never again over a newer value
        assert seen(other, 16384) == 0 and seen(other, 24576) == 0
        assert wait_for(lambda: seen(other, 16384) == 9 and seen(other, 24576) == 5, 5)
        assert len(simulator.side_files(path)) == 3  # the registry, two live caches
        other.close()
    finally:
        mine.unlink()
        mine.close()
    assert simulator.side_files(path) == []



def test_evict_near_reaches_the_lines_around_a_call_in_a_big_region(name, monkeypatch):
    """EVICT_NEAR: in an 8 MiB region one random line a call is inert; near the call's range
    it evicts a line left dirty beside it within a few calls."""
    monkeypatch.setattr(simulator, "EVICTION_RATE", 1.0)
    monkeypatch.setattr(simulator, "EVICT_NEAR", 4)
    url = f"sim://{name}"
    writer = Region.create(url, 8 * MiB, kind=9)
    try:
        writer.publish()
        with Region.open(url) as reader:
            writer.mem.store(4 * MiB + 128, 3, RELEASE)  # never written back
            for _ in range(200):
                writer.mem.writeback(4 * MiB, 8)  # a line two away
                reader.mem.invalidate(4 * MiB + 128, 8)
                if reader.mem.load(4 * MiB + 128, ACQUIRE) == 3:
                    break
            assert reader.mem.load(4 * MiB + 128, ACQUIRE) == 3
    finally:
        writer.unlink()
        writer.close()
