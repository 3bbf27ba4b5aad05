"""Write-back and invalidate sites of the Python reference that the RPC and ring mutation tests
do not reach (issue 42: removed in turn, nothing failed), each with a scenario that shows what
it is for: the scenario passes as the code stands and fails with that one call removed
(``flush_masks.remove``); and the SPSC ring's order (records written back before the tail
that publishes them is stored), which a consumer looking the moment the tail lands shows.

Every mapping of a ``sim://`` region is a host of its own here (its own cache), with no random
evictions (a forgotten line stays forgotten). CXLRPC_NO_NATIVE is not needed: every site here
is Python's, and the ring scenario runs the reference's methods by name."""
from __future__ import annotations

import inspect
import os
import textwrap
import threading
from typing import Callable

import pytest

import cxlrpc.memory
import cxlrpc.simulator
from cxlrpc.channel import (KIND_RPC, STATE_CLOSED, FlushServerChannel, client_channel, layout,
                            read_geometry, server_channel)
from cxlrpc.memory import RELEASE
from cxlrpc.region import _IDENTITY, HEADER_SIZE, Region, _heartbeat_moves
from cxlrpc.identity import host_identity
from cxlrpc.ring import SpscRing, ring_size
from cxlrpc.ring import spsc
from flush_masks import remove, site
from kvservice.pool import Pool

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_evictions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cxlrpc.simulator, "EVICTION_RATE", 0.0)


def _owner(url: str, size: int = 1 << 16, identity: int | None = None) -> Region:
    """A published region; ``identity``: the owner's host identity it writes (another host's)."""
    owner = Region.create(url, size, kind=9)
    if identity is not None:
        owner.mem.store(_IDENTITY, identity, RELEASE)
    owner.publish()
    return owner


def _heartbeat_seen(url: str) -> str | None:
    """Region.beat / Region.heartbeat_value: a peer sees the owner's heartbeat move (else its
    clients judge a live server gone after server_timeout)."""
    owner = _owner(url)
    peer = Region.open(url)
    try:
        before = peer.heartbeat_value()
        owner.beat()
        return None if peer.heartbeat_value() != before else "the peer never saw the heartbeat move"
    finally:
        peer.close()
        owner.unlink()
        owner.close()


def _close_seen(url: str) -> str | None:
    """Region.mark_closed / info / owner_alive_locally: a peer sees a clean close at once
    (else a client waits for the server timeout, a new server for the stale window)."""
    owner = _owner(url)
    peers = [Region.open(url) for _ in range(2)]  # (each call's invalidate would serve the other)
    try:
        owner.mark_closed()
        if not peers[0].info().closed:
            return "info() says the closed region is open"
        if peers[1].owner_alive_locally() is not False:
            return "owner_alive_locally() says the closed region's owner serves"
        return None
    finally:
        for peer in peers:
            peer.close()
        owner.unlink()
        owner.close()


def _remote_heartbeat_seen(url: str) -> str | None:
    """_heartbeat_moves, its polls: another host's owner that beats is alive."""
    owner = _owner(url, identity=host_identity() ^ 1)
    peer = Region.open(url)
    stop = threading.Event()

    def beating() -> None:
        while not stop.wait(0.01):
            owner.beat()

    beater = threading.Thread(target=beating)
    beater.start()
    try:
        return None if peer.owner_alive(0.3) else "a beating owner on another host was judged dead"
    finally:
        stop.set()
        beater.join()
        peer.close()
        owner.unlink()
        owner.close()


def _stale_start_not_a_move(url: str) -> str | None:
    """_heartbeat_moves, its first read: a heartbeat that moved before the window (the peer's
    cached copy is older) and then stopped is not a move (a dead owner is not taken for alive).
    Every caller invalidates the header first as well, so only a direct call shows it."""
    owner = _owner(url, identity=host_identity() ^ 1)
    peer = Region.open(url)
    try:
        for _ in range(3):
            owner.beat()  # and stops: dead
        return "a stopped heartbeat was taken for a move" if _heartbeat_moves(peer.mem, 0.1) else None
    finally:
        peer.close()
        owner.unlink()
        owner.close()


def _geometry_reread(url: str) -> str | None:
    """read_geometry: a mapping that read a server's control block reads the next server's,
    not its cached copy (which passes its checksum: it was a server's)."""
    old, new = layout(2, 1024, 1024, "flush"), layout(1, 1024, 1024, "flush")
    region = Region.create(url, old.size, KIND_RPC, coherence="flush")
    first = server_channel(region, old)
    region.publish()
    peer = Region.open(url)
    try:
        if read_geometry(peer) != old:
            return "the first server's geometry was misread"
        first.close()
        second = server_channel(region, new)  # a server that took the same memory over
        region.mem.writeback(0, region.size)  # (as its publish does)
        got = read_geometry(peer, patience=0.1)
        second.close()
        return None if got == new else f"read {got}, the server wrote {new}"
    finally:
        peer.close()
        region.unlink()
        region.close()


def _freed_block_unheld(url: str) -> str | None:
    """Pool.clear: a reader whose lease lapsed does not accept a freed block's bytes once a
    put reuses them (its version check reads the cleared entry; the put's claim is on another
    entry, in another line, as for a block that starts before it)."""
    unit = 64
    server = Pool.create(f"{url}.pool", 32 * unit, unit, coherence="flush")
    reader = Pool.open(f"{url}.pool", 32 * unit, server.region.epoch, unit)
    try:
        old = 8 * unit  # its version entry is the first of the table's second line
        server.publish(old, 5)
        entry = reader._entry(old)
        if not reader.holds(entry, 5):
            return "the published version was not seen"
        server.clear(old)
        server.claim(0, 77)  # a put of 16 units from 0: over the freed block
        return "a lapsed reader still holds the freed block" if reader.holds(entry, 5) else None
    finally:
        reader.close()
        server.retire()
        server.close()


def _flush_server(url: str) -> tuple[Region, FlushServerChannel]:
    geo = layout(1, 1024, 1024, "flush")
    region = Region.create(url, geo.size, KIND_RPC, coherence="flush")
    server = server_channel(region, geo)
    region.publish()
    assert isinstance(server, FlushServerChannel)
    return region, server


def _new_holder_seen(url: str) -> str | None:
    """FlushClientChannel._take: the server reads a new holder's line (its PID) at once, not
    only after its first heartbeat writes the line back (masked so in the RPC scenario)."""
    region, server = _flush_server(url)
    client = client_channel(Region.open(url))
    try:
        server.reap(1.0, 0.0)
        if not client.acknowledged():
            return "no grant"
        info = server.peer_info(client.slot)
        return None if info == (client.gen, os.getpid(), host_identity()) else f"the server read {info}"
    finally:
        client.detach()
        client.region.close()
        server.close()
        region.unlink()
        region.close()


def _closed_state_seen(url: str) -> str | None:
    """FlushServerChannel.close / FlushClientChannel._server_state: a client reads the closed
    state word (in the RPC scenario the region header's close, read too, masks both)."""
    region, server = _flush_server(url)
    client = client_channel(Region.open(url))  # (it read the running state)
    try:
        server.close()
        return None if client._server_state() == STATE_CLOSED else "the closed server reads running"
    finally:
        client.region.close()
        region.unlink()
        region.close()


#: (file, function, nth call) -> the scenario that needs it.
SITES: dict[tuple[str, str, int], Callable[[str], str | None]] = {
    ("cxlrpc/region.py", "Region.beat", 0): _heartbeat_seen,
    ("cxlrpc/region.py", "Region.heartbeat_value", 0): _heartbeat_seen,
    ("cxlrpc/region.py", "Region.mark_closed", 0): _close_seen,
    ("cxlrpc/region.py", "Region.info", 0): _close_seen,
    ("cxlrpc/region.py", "Region.owner_alive_locally", 0): _close_seen,
    ("cxlrpc/region.py", "_heartbeat_moves", 0): _stale_start_not_a_move,
    ("cxlrpc/region.py", "_heartbeat_moves", 1): _remote_heartbeat_seen,
    ("cxlrpc/channel.py", "read_geometry", 0): _geometry_reread,
    ("kvservice/pool.py", "Pool.clear", 0): _freed_block_unheld,
    ("cxlrpc/channel.py", "FlushClientChannel._take", 0): _new_holder_seen,
    ("cxlrpc/channel.py", "FlushServerChannel.close", 0): _closed_state_seen,
    ("cxlrpc/channel.py", "FlushClientChannel._server_state", 0): _closed_state_seen,
}


@pytest.mark.parametrize("key", list(SITES), ids=[f"{f.split('/')[-1]}:{fn}:{n}" for f, fn, n in SITES])
def test_removing_the_site_breaks_its_scenario(name: str, key: tuple[str, str, int],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = SITES[key]
    assert scenario(f"sim://{name}") is None
    remove(monkeypatch, site(*key))
    assert scenario(f"sim://{name}b") is not None, f"removing {key} went unnoticed"


@pytest.mark.skipif(cxlrpc.memory._native is None, reason="cxlrpc._flush was not built")
def test_opening_real_flush_memory_drops_what_an_earlier_mapping_cached(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Region.__init__'s invalidate of the whole mapping on real memory without coherence
    (not the simulator's: its mappings start cold). This machine is coherent, so nothing a
    peer reads can show a stale line: the lines the CPU is told to drop are counted instead."""
    owner = Region.create(f"shm://{name}", 1 << 16, kind=9, coherence="flush")
    owner.publish()

    def dropped_at_open() -> int:
        peer = Region.open(f"shm://{name}")
        try:
            assert peer.mem.lines is not None
            return peer.mem.lines.counts()["lines"]
        finally:
            peer.close()

    try:
        assert dropped_at_open() >= owner.size // 64
        remove(monkeypatch, site("cxlrpc/region.py", "Region.__init__"))
        assert dropped_at_open() < owner.size // 64
    finally:
        owner.unlink()
        owner.close()


# ---------------------------------------------------------------------- the SPSC ring's order
def _tail_first(method: Callable[..., bool]) -> Callable[..., bool]:
    """``method`` (the reference push) with the records' write-back moved after the tail's
    store and write-back: the ordering mutation."""
    lines = textwrap.dedent(inspect.getsource(method)).splitlines()
    data = [i for i, line in enumerate(lines) if "self._span(self.mem.writeback" in line][0]
    block = lines[data - 1:data + 1]  # the "if self._flushing:" and the write-back
    del lines[data - 1:data + 1]
    at = [i for i, line in enumerate(lines) if "self.mem.writeback(self._tail_at" in line][0]
    lines[at + 1:at + 1] = block
    scope = dict(vars(spsc))
    exec(compile("\n".join(lines), spsc.__file__, "exec"), scope)
    return scope[method.__name__]  # type: ignore[no-any-return]


class _Reference(SpscRing):
    try_push_parts = SpscRing._try_push_parts_py
    poll = SpscRing._poll_py


class _TailFirst(_Reference):
    try_push_parts = _tail_first(SpscRing._try_push_parts_py)


@pytest.mark.parametrize("producer_cls, whole", [(_Reference, True), (_TailFirst, False)],
                         ids=["reference", "tail-before-data"])
def test_a_consumer_that_looks_when_the_tail_lands_reads_the_record_whole(name, monkeypatch,
                                                                           producer_cls, whole):
    """The consumer polls right after the producer's tail is written back (a peer on another
    host may look at any moment): it must read the record whole, so the record's lines must be
    written back before the tail is stored. The ordering mutation drops the record instead."""
    capacity = 4096
    region = Region.create(f"sim://{name}", HEADER_SIZE + ring_size(capacity), kind=9)
    _Reference(region.buf, region.mem, HEADER_SIZE, capacity).reset()
    region.publish()
    views = [Region.open(region.url) for _ in range(2)]
    try:
        producer = producer_cls(views[0].buf, views[0].mem, HEADER_SIZE, capacity)
        consumer = _Reference(views[1].buf, views[1].mem, HEADER_SIZE, capacity)
        got: list[bytes] = []
        tail_at = producer._tail_at
        writeback = type(views[0].mem).writeback

        def looking(mem, offset: int, length: int) -> None:
            writeback(mem, offset, length)
            if mem is views[0].mem and offset == tail_at:  # the tail landed: the consumer looks
                consumer.poll(lambda view: got.append(bytes(view)))

        monkeypatch.setattr(type(views[0].mem), "writeback", looking)
        record = bytes(range(256)) * 2
        assert producer.try_push_parts([record])
        assert (got == [record]) is whole, (got[:1], consumer.dropped)
    finally:
        for v in views:
            v.close()
        region.unlink()
        region.close()
